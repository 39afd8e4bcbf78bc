"""Bad speculative_config values are refused with a ValueError naming the field (no engine)."""

import pytest

from pagedllm.speculative_config import SpeculativeConfig


@pytest.mark.parametrize("cfg, field", [
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "suffix", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": "x"},
     "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2.0},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5,
      "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
    ("suffix", "must be a dict"),
    ([{"method": "suffix"}], "must be a dict"),
])
def test_bad_values_name_the_field(cfg, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(cfg)


def test_good_config_accepted():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_min": 2, "prompt_lookup_max": 2})
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min) == (3, 2)
