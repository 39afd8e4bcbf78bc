"""Write a bench preset's F32 GGUF with the project's converter mimic, where llama.cpp's own
convert_hf_to_gguf.py stops at the vocabulary.

The `deepseek-v2-lite-200m` and `qwen3-next-200m` presets carry the synthetic byte-level BPE
tokenizer of `pagedllm/benchmarks/presets.py`. llama.cpp's converter (llama-cpp-python 0.3.36's
vendor/llama.cpp) writes a `deepseek2` or `qwen3next` vocabulary only through its GPT-2 BPE path,
which accepts a tokenizer only when the hash of its pre-tokenizer's output is one of known models
("BPE pre-tokenizer was not recognized"); the Llama-2 stand-in vocabulary that
`llamacpp_baseline.convert_to_gguf` retries with serves only the Llama-family converters. So the
file is written by `tests/fixtures/gguf_converted.write_converted_gguf` (the converter's metadata
keys, tensor names and layout changes; checked tensor by tensor against the real converter for
deepseek2 and qwen3next), tokenizer as GPT-2 BPE with the
"default" pre-tokenizer. It lands where `pagedllm bench --compare llamacpp` looks for the
converted file (`<preset folder>/model-f32.gguf`), so llama.cpp runs the same weights as the
engine; the bench feeds token ids, so the vocabulary step does not change the workload.

A DeepSeek-V2 file without q_lora (the preset, as V2-Lite) gets `deepseek2.attention.q_lora_rank`
= 0: the converter writes no such key then, and llama.cpp (src/models/deepseek2.cpp) reads the
key as required unless the model has V2-Lite's own layer count (26 or 27), so the preset's 8-layer
file would not load; with 0 it takes its no-q_lora path (`wq`), as for V2-Lite.

    PYTHONPATH=. python scripts/write_preset_gguf.py qwen3-next-200m deepseek-v2-lite-200m
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagedllm.benchmarks.presets import preset_path
from tests.fixtures.gguf_converted import write_converted_gguf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("presets", nargs="+")
    p.add_argument("--preset-dir", default=None)
    args = p.parse_args()
    for name in args.presets:
        folder = Path(preset_path(name, "float32", args.preset_dir))
        out = folder / "model-f32.gguf"
        tmp = out.with_suffix(".tmp")
        config = json.loads((folder / "config.json").read_text())
        overrides = ({"deepseek2.attention.q_lora_rank": 0}
                     if config["architectures"][0].startswith("Deepseek")
                     and config.get("q_lora_rank") is None else None)
        write_converted_gguf(folder, tmp, "F32", metadata_overrides=overrides)
        tmp.replace(out)
        print(out)


if __name__ == "__main__":
    main()
