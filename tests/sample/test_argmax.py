import numpy as np
import torch

from pagedllm.sample.ops.argmax import row_argmax


def test_row_argmax_is_torch_argmax():
    """The numpy path (CPU float32) against torch.argmax: random rows, ties (first index), NaN
    (the first NaN wins), -inf rows, a non-contiguous view; other dtypes take torch's path."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=g)
    x[1, [7, 500]] = 50.0                       # a tie: the first index
    x[2, [9, 600]] = float("nan")               # NaN beats everything: the first NaN
    x[3] = float("-inf")                        # all -inf: index 0
    x[4, :] = 1.0
    for view in (x, x[:, ::2], x[::2]):
        got = row_argmax(view)
        assert got.dtype == torch.int64 and torch.equal(got, view.argmax(dim=-1))
    assert row_argmax(x)[1:4].tolist() == [7, 9, 0]
    half = x.to(torch.bfloat16)
    assert torch.equal(row_argmax(half), half.argmax(dim=-1))
    assert isinstance(row_argmax(x).numpy(), np.ndarray)
