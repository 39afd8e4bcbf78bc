"""GGUF files (llama.cpp's format) as checkpoints: a cached checkpoint *view* plus lazy tensors.

    model.gguf ──(first use)──► <cache>/<key>/  config.json, generation_config.json,
                                                tokenizer.json, tokenizer_config.json,
                                                chat_template.jinja,
                                                gguf.json (the file, its tensor table)
    load_model(<view>) ──► GGUFTensor per file tensor
                       ──► model family: HF names, Q/K row order (map)
                       ──► weight_loader: narrow for TP ──► dequantize to float32, cast

The view is derived once with transformers' own GGUF support (the oracle's reading of the file), so
everything that takes a checkpoint folder (hf_model_info, tokenizers, the chat template, workers'
AutoConfig) works unchanged; `gguf.json` points back at the file for the weights and keeps its
tensor table (name, type, shape, byte offset), so loading memory-maps the data directly instead of
parsing the metadata again (seconds for a 50k-token vocabulary). Weights are dequantized at load
(`materialize`), or handed over in their blocks (`materialize_raw`) to linear layers that keep
them quantized (layers/quantization/gguf.py). This module knows the file
format, never an architecture's tensor names: those sit with the model family (e.g.
`LlamaForCausalLM.gguf_checkpoint_weights`). Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm import envs
from pagedllm.model_loader.slicing import narrow_index

VIEW_FORMAT = 4  # bump when the files of a view change
SOURCE_FILE = "gguf.json"

# GGML tensor types loaded (dequantized with `gguf.quants.dequantize`, checked against independent
# references in tests/model_loader/test_gguf.py). IQ1_M, TQ*, MXFP4 and the integer types are
# refused.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K",
                          "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_S",
                          "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S")


def is_gguf_path(model: str) -> bool:
    """Whether `model` names a GGUF file (by its `.gguf` suffix; the file need not exist)."""
    return str(model).lower().endswith(".gguf")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lies in a GGUF file.

    Attributes:
        name: llama.cpp's tensor name ("blk.0.attn_q.weight").
        tensor_type: GGML type name ("Q4_1").
        shape: torch order ([out_features, in_features]; GGUF lists dims innermost first).
        offset: absolute byte offset of the data in the file.
        n_bytes: bytes of data.
    """

    name: str
    tensor_type: str
    shape: tuple[int, ...]
    offset: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFSource:
    """The GGUF file behind a checkpoint view (the contents of its `gguf.json`).

    Attributes:
        path: absolute path of the .gguf file.
        architecture: the file's `general.architecture` (llama.cpp's name, e.g. "llama").
        size, mtime_ns: the file's size in bytes and modification time when the view was built.
        tensors: the file's tensors, in file order.
    """

    path: str
    architecture: str
    size: int
    mtime_ns: int
    tensors: tuple[GGUFTensorInfo, ...]

    def to_json(self) -> str:
        return json.dumps({**self.__dict__, "tensors": [t.__dict__ for t in self.tensors]})

    @classmethod
    def from_json(cls, text: str) -> GGUFSource:
        """Raises ValueError / TypeError / KeyError on malformed text."""
        d = json.loads(text)
        tensors = tuple(GGUFTensorInfo(**{**t, "shape": tuple(t["shape"])})
                        for t in d.pop("tensors"))
        return cls(**d, tensors=tensors)


def read_gguf_source(model_path: str) -> GGUFSource | None:
    """The GGUF file a checkpoint view points at; None for an ordinary checkpoint folder.

    Raises:
        FileNotFoundError: the .gguf file is gone.
        ValueError: a corrupt `gguf.json`, or a file changed since the view was built (resolve the
            .gguf path again to rebuild it).
    """
    pointer = Path(model_path) / SOURCE_FILE
    if not pointer.is_file():
        return None
    try:
        source = GGUFSource.from_json(pointer.read_text())
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"corrupt GGUF pointer {pointer}: {e}") from e
    try:
        stat = os.stat(source.path)
    except FileNotFoundError:
        raise FileNotFoundError(f"GGUF file {source.path} (behind {model_path}) not "
                                "found") from None
    if (stat.st_size, stat.st_mtime_ns) != (source.size, source.mtime_ns):
        raise ValueError(f"GGUF file {source.path} changed since its checkpoint view {model_path} "
                         "was built; load the .gguf path again")
    return source


def gguf_cache_root() -> Path:
    """Where checkpoint views live: $PAGEDLLM_GGUF_CACHE, else ~/.cache/pagedllm/gguf."""
    root = envs.get("PAGEDLLM_GGUF_CACHE")
    return root if root is not None else Path.home() / ".cache" / "pagedllm" / "gguf"


def _view_key(path: Path, stat: os.stat_result) -> str:
    import transformers

    # The view is transformers' reading of the file: a new transformers may read it differently.
    text = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{VIEW_FORMAT}\0{transformers.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def prune_stale_views(root: Path | None = None) -> list[str]:
    """Delete the checkpoint views that can never be used again: their GGUF file is gone or
    changed, or they were built by another view format or transformers version (a fresh load
    builds a new view). Runs whenever a view is built, so the cache holds about one view per
    GGUF file in use. Unreadable entries are left alone. Returns the deleted folders.
    """
    root = gguf_cache_root() if root is None else root
    deleted = []
    for view in sorted(root.iterdir()) if root.is_dir() else ():
        if view.name.startswith(".") or not (view / SOURCE_FILE).is_file():
            continue
        try:
            source = GGUFSource.from_json((view / SOURCE_FILE).read_text())
        except (OSError, ValueError, TypeError, KeyError):
            continue
        try:
            current = _view_key(Path(source.path), os.stat(source.path)) == view.name
        except OSError:
            current = False
        if not current:
            shutil.rmtree(view, ignore_errors=True)
            deleted.append(str(view))
    return deleted


def prepare_gguf_view(gguf_file: str) -> str:
    """The checkpoint view folder of a GGUF file, built on first use and cached.

    The cache key hashes the file's absolute path, size and mtime (and the transformers version),
    so a changed file gets a new view. The architecture and every tensor type are checked before
    anything is derived.

    Returns:
        The absolute path of the view folder.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a readable GGUF file, an unsupported architecture or tensor type (naming
            it), or metadata transformers cannot turn into a config or tokenizer.
    """
    path = Path(gguf_file).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_file}")
    stat = path.stat()
    view = gguf_cache_root() / _view_key(path, stat)
    if (view / SOURCE_FILE).is_file():
        return str(view)
    reader = open_gguf(path)
    architecture = _metadata(reader, "general.architecture")
    from pagedllm.models.registry import resolve_gguf_architecture
    model_cls = resolve_gguf_architecture(architecture, str(path))
    check_tensor_types(tensor_table(reader), path)
    tmp = view.parent / f".{view.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_view(tmp, path, reader, model_cls)
        source = GGUFSource(str(path), architecture, stat.st_size, stat.st_mtime_ns,
                            tensor_table(reader))
        (tmp / SOURCE_FILE).write_text(source.to_json())
        try:
            os.rename(tmp, view)
        except OSError:  # another process built the same view first
            if not (view / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune_stale_views(view.parent)
    return str(view)


def _write_view(folder: Path, path: Path, reader, model_cls) -> None:
    """config.json, the tokenizer files and generation_config.json of `path`, into `folder`.

    The config is transformers' reading of the file, or for a family whose architecture
    transformers' GGUF reader does not know (deepseek2, glm4moe, mamba2, qwen3next, qwen35,
    granitehybrid, falcon-h1) the family's own
    (`model_cls.gguf_hf_config(metadata_values(reader), {tensor name: torch-order shape})`,
    which raises ValueError naming a missing or unsupported key); the tokenizer is
    always transformers' (its tokenizer reading does not depend on the architecture).
    """
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    kwargs = {"gguf_file": path.name, "local_files_only": True}
    # transformers reads the folder it is given: tokenizer or config files of another checkpoint
    # next to the .gguf file would win over the file's own metadata (its chat template and
    # BOS/EOS lost), so it reads a folder holding nothing but a link to the file.
    with tempfile.TemporaryDirectory(dir=folder.parent) as alone:
        try:
            (Path(alone) / path.name).symlink_to(path)
            source = alone
        except OSError:   # no symlinks here (some Windows set-ups): read the file in place
            source = str(path.parent)
        own_config = getattr(model_cls, "gguf_hf_config", None)
        try:
            if own_config is None:
                config = AutoConfig.from_pretrained(source, **kwargs)
                tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            else:
                tokenizer = PreTrainedTokenizerFast.from_pretrained(source, **kwargs)
        except (OSError, ValueError, KeyError, NotImplementedError) as e:
            raise ValueError(f"transformers could not read the config or tokenizer of GGUF file "
                             f"{path}: {e}") from e
    if own_config is not None:
        try:
            config = own_config(metadata_values(reader),
                                {t.name: t.shape for t in tensor_table(reader)})
        except ValueError as e:
            raise ValueError(f"GGUF file {path}: {e}") from e
        special = _generation_config(reader)   # the file's own ids, not the config defaults
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(config, key, special.get(key))
    else:
        config.architectures = [model_cls.__name__]
        _fix_transformers_config(config, reader, path)
    config.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(
        json.dumps(_generation_config(reader), indent=2))


def _fix_transformers_config(config, reader, path: Path) -> None:
    """What transformers' GGUF config reader leaves out or gets wrong for its families."""
    arch = _metadata(reader, "general.architecture")
    # NOTE(gguf): transformers reads head_dim from rope.dimension_count for llama only; the
    # converter writes the true head size as attention.key_length (Qwen3: 128 != hidden/heads).
    key_length = _metadata(reader, f"{arch}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length)
    _add_llama3_rope_scaling(config, reader, path)
    if arch == "gemma2":
        _add_gemma2_settings(config, reader)
    elif arch == "phi3":
        _add_phi3_settings(config, reader)
    if arch in ("qwen2moe", "qwen3moe"):
        _add_qwen_moe_settings(config, reader, arch)


def _add_qwen_moe_settings(config, reader, arch: str) -> None:
    """Qwen MoE settings transformers' GGUF reader drops: the expert and shared-expert sizes
    (`{arch}.expert_feed_forward_length`, `expert_shared_feed_forward_length`), and for
    Qwen3-MoE `norm_topk_prob`, which files do not store: llama.cpp always renormalises
    Qwen3-MoE's top-k weights (the released models set it) and never Qwen2-MoE's."""
    size = _metadata(reader, f"{arch}.expert_feed_forward_length")
    if size is not None:
        config.moe_intermediate_size = int(size)
    shared = _metadata(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared is not None:
        config.shared_expert_intermediate_size = int(shared)
    config.norm_topk_prob = arch == "qwen3moe"


def metadata_values(reader) -> dict[str, Any]:
    """Every metadata key of an open file (`open_gguf`) but the tokenizer's, as Python values:
    numbers, strings, bools, and arrays of them as lists (llama.cpp writes per-layer values,
    e.g. LFM2's `attention.head_count_kv`, as arrays)."""
    from gguf import GGUFValueType

    values: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith(("tokenizer.", "GGUF.")) or not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            if len(field.types) > 1 and field.types[1] == GGUFValueType.STRING:
                values[key] = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                values[key] = [field.parts[i].tolist()[0] for i in field.data]
        else:
            values[key] = _metadata(reader, key)
    return values


def _add_gemma2_settings(config, reader) -> None:
    """Gemma 2 settings transformers' GGUF reader leaves at its defaults: the attention and final
    logit soft-caps (`gemma2.attn_logit_softcapping`, `gemma2.final_logit_softcapping`; absent
    means none), and the query scale, which files do not store: llama.cpp uses
    hidden_size / num_heads for the 46-layer 27B model and head_dim otherwise, as released."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = _metadata(reader, f"gemma2.{key}")
        setattr(config, key, float(value) if value is not None else None)
    heads = config.num_attention_heads
    config.query_pre_attn_scalar = (config.hidden_size // heads if config.num_hidden_layers == 46
                                    else config.head_dim)


def _add_phi3_settings(config, reader) -> None:
    """Phi-3 settings transformers' GGUF reader drops: the sliding window
    (`phi3.attention.sliding_window`), partial RoPE (`phi3.rope.dimension_count` < head size)
    and LongRoPE, which llama.cpp stores as the tensors `rope_factors_long/short.weight` plus
    `phi3.rope.scaling.original_context_length` and `.attn_factor` (kept only when it differs
    from the factor's default, sqrt(1 + ln(factor) / ln(original)))."""
    window = _metadata(reader, "phi3.attention.sliding_window")
    if window is not None:
        config.sliding_window = int(window)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size
                                                     // config.num_attention_heads)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rotary = _metadata(reader, "phi3.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        rope["partial_rotary_factor"] = int(rotary) / head_dim
    factors = {t.name: np.array(t.data, np.float32).tolist() for t in reader.tensors
               if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    original = _metadata(reader, "phi3.rope.scaling.original_context_length")
    if len(factors) == 2 and original is not None:
        rope.update(rope_type="longrope", long_factor=factors["rope_factors_long.weight"],
                    short_factor=factors["rope_factors_short.weight"],
                    original_max_position_embeddings=int(original))
        config.original_max_position_embeddings = int(original)
        attn_factor = _metadata(reader, "phi3.rope.scaling.attn_factor")
        scale = config.max_position_embeddings / int(original)
        default = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(int(original)))
        if attn_factor is not None and not math.isclose(attn_factor, default, rel_tol=1e-6):
            rope["attention_factor"] = float(attn_factor)
    config.rope_parameters = rope


def _add_llama3_rope_scaling(config, reader, path: Path) -> None:
    """Put a Llama 3.1+ file's RoPE scaling into the config: llama.cpp stores it only as the
    frequency factors `rope_freqs.weight`, which transformers' GGUF reader drops (its config then
    says default RoPE). The llama3 parameters that reproduce the factors exactly are written;
    when none do, the config is left as it is and the loader refuses the file, naming the
    mismatch (models/llama.py checks `rope_freqs.weight` against the config)."""
    from pagedllm.layers.rotary_embedding import infer_llama3_rope_parameters

    rope = dict(getattr(config, "rope_parameters", None) or {})
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None or rope.get("rope_type", "default") != "default" or \
            tensor.tensor_type.name != "F32":
        return
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size
                                                     // config.num_attention_heads)
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    params = infer_llama3_rope_parameters(torch.from_numpy(np.array(tensor.data, np.float32)),
                                          head_dim, theta)
    if params is not None:
        config.rope_parameters = params


# llama.cpp's sampling defaults (general.sampling.*) -> generation_config.json names.
_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "penalty_repeat": "repetition_penalty"}


# End-of-turn tokens a file may not declare (Gemma's GGUF files state only <eos>), found by their
# text as llama.cpp's vocabulary loader does.
_END_OF_TURN_TEXTS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>")


def _generation_config(reader) -> dict[str, Any]:
    """BOS/PAD and every end-of-generation id (eos, eot, eom, and the end-of-turn tokens found by
    their text), plus sampling defaults if stated."""
    gen: dict[str, Any] = {}
    for key in ("bos", "padding"):
        value = _metadata(reader, f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            gen["bos_token_id" if key == "bos" else "pad_token_id"] = int(value)
    eos = [int(v) for k in ("eos", "eot", "eom")
           if (v := _metadata(reader, f"tokenizer.ggml.{k}_token_id")) is not None]
    eos += _token_ids(reader, _END_OF_TURN_TEXTS)
    if eos:
        gen["eos_token_id"] = list(dict.fromkeys(eos)) if len(set(eos)) > 1 else eos[0]
    for key, name in _SAMPLING_KEYS.items():
        value = _metadata(reader, f"general.sampling.{key}")
        if value is not None:
            gen[name] = value
    return gen


def _token_ids(reader, texts: tuple[str, ...]) -> list[int]:
    """Ids of the vocabulary tokens (`tokenizer.ggml.tokens`) spelled as one of `texts`."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return []
    wanted = {t.encode() for t in texts}
    return [i for i, part in enumerate(field.data) if bytes(field.parts[part]) in wanted]


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` over `path` (memory-mapped; tensors are not read yet).

    Raises:
        ValueError: naming the file when it is not a valid GGUF file.
    """
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct errors, IndexError, ...
        raise ValueError(f"not a valid GGUF file: {path} (truncated or corrupt? the reader "
                         f"said {type(e).__name__}: {e})") from e


def _metadata(reader, key: str) -> Any:
    """A scalar or string metadata value of the file, None when absent (arrays are not read)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None or not field.types or field.types[0] == GGUFValueType.ARRAY:
        return None
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value.tolist()[0]


def tensor_table(reader) -> tuple[GGUFTensorInfo, ...]:
    """The tensors of an open file (`open_gguf`), in file order."""
    return tuple(GGUFTensorInfo(t.name, t.tensor_type.name,
                                tuple(int(d) for d in reversed(t.shape.tolist())),
                                int(t.data_offset), int(t.n_bytes)) for t in reader.tensors)


def check_tensor_types(tensors: tuple[GGUFTensorInfo, ...], path: str | Path) -> None:
    """Raises ValueError naming the first tensor whose type is not in SUPPORTED_TENSOR_TYPES."""
    for tensor in tensors:
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(f"GGUF tensor type {tensor.tensor_type} (tensor {tensor.name} of "
                             f"{path}) is not supported; supported: "
                             f"{', '.join(SUPPORTED_TENSOR_TYPES)}")


def dequantize(data: np.ndarray, tensor_type: str) -> np.ndarray:
    """Unpack GGML blocks to float32.

    Args:
        data: the tensor's bytes as `tensor_data` maps them: [..., row_bytes] uint8 for block
            types (BF16 included), [..., row] float32/float16 for F32/F16.
        tensor_type: a GGML type name in SUPPORTED_TENSOR_TYPES.

    Returns:
        float32 [..., row] (row = elements per row; the leading dims are unchanged).
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    # NOTE(gguf): a plain ndarray, not a np.memmap: numpy's memmap subclass hooks cost seconds
    # over the thousands of views gguf's block loops make.
    out = gguf_dequantize(np.asarray(data), GGMLQuantizationType[tensor_type])
    return np.asarray(out, dtype=np.float32)


def tensor_data(buffer: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """The bytes of one tensor in `buffer` (the whole file, uint8), shaped as `dequantize` takes
    them: [*shape] float32/float16 for F32/F16, [*shape[:-1], row_bytes] uint8 otherwise.

    Raises:
        ValueError: naming the tensor when the file is too short for it.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    raw = buffer[info.offset:info.offset + info.n_bytes]
    if raw.size != info.n_bytes:
        raise ValueError(f"GGUF tensor {info.name} runs past the end of the file")
    if info.tensor_type in ("F32", "F16"):
        return raw.view(np.float32 if info.tensor_type == "F32" else np.float16).reshape(
            info.shape)
    qtype = GGMLQuantizationType[info.tensor_type]
    return raw.reshape(quant_shape_to_byte_shape(info.shape, qtype))


class GGUFTensor:
    """A GGUF tensor not read yet; `narrow` selects a slice, `materialize` dequantizes it.

    `shape` is in torch order ([out_features, in_features] for a weight). `map(fn)` adds a
    function applied to the whole dequantized float32 tensor before any slice is taken (e.g. a
    model family undoing llama.cpp's Q/K row order). Without a map, a slice along dim 0
    dequantizes only its rows.

    Raises (from `narrow`): ValueError for a slice outside the tensor. (From `map`): ValueError
    once narrowed. (From `materialize`): ValueError naming the tensor when its bytes do not
    unpack.
    """

    def __init__(self, buffer: np.ndarray, info: GGUFTensorInfo, dtype: torch.dtype,
                 transforms: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = (),
                 shape: tuple[int, ...] | None = None,
                 index: tuple[slice, ...] | None = None) -> None:
        self._buffer, self._info, self.dtype = buffer, info, dtype
        self._transforms = transforms
        self.name = info.name
        self.shape = torch.Size(info.shape if shape is None else shape)
        self._index = index

    def narrow(self, dim: int, start: int, length: int) -> GGUFTensor:
        shape, index = narrow_index(self.shape, self._index, dim, start, length,
                                    f"GGUF tensor {self.name}")
        return GGUFTensor(self._buffer, self._info, self.dtype, self._transforms, shape, index)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> GGUFTensor:
        if self._index is not None:
            raise ValueError(f"GGUF tensor {self.name}: map() must come before narrow()")
        return GGUFTensor(self._buffer, self._info, self.dtype, self._transforms + (fn,))

    def materialize(self) -> torch.Tensor:
        info, index = self._info, self._index
        try:
            data = tensor_data(self._buffer, info)
            if index is not None and not self._transforms and len(info.shape) > 1:
                data, index = data[index[0]], (slice(None),) + index[1:]
            values = dequantize(data, info.tensor_type)
        except ValueError as e:  # numpy reshape errors on truncated or odd-sized data
            raise ValueError(f"GGUF tensor {info.name} ({info.tensor_type}) does not unpack: "
                             f"{e}") from e
        tensor = torch.from_numpy(values if values.flags.writeable else values.copy())
        for fn in self._transforms:
            tensor = fn(tensor)
        if index is not None:
            tensor = tensor[index]
        return tensor.to(self.dtype).contiguous()

    @property
    def tensor_type(self) -> str:
        """The GGML type name of the tensor in the file ("Q4_1")."""
        return self._info.tensor_type

    def expert(self, expert: int) -> GGUFExpert:
        """Expert `expert` of this 3-D tensor of stacked experts, as a lazy 2-D tensor
        (`GGUFExpert`; ValueError when this is no such tensor)."""
        return GGUFExpert(self, expert)

    def materialize_raw(self) -> torch.Tensor:
        """The selected slice still in its GGML block format, for quantized linear layers
        (`layers/quantization/gguf.py`).

        Returns:
            [rows, row_bytes] uint8 (a copy): each row the slice's blocks in file order.

        A 3-D tensor (llama.cpp's stacked experts, [experts, rows, cols]) must be narrowed to
        one expert first; its rows and columns are then sliced as a 2-D tensor's.
        A map (`map`) must only reorder rows (as `unpermute_rope_rows` does): it is applied to
        the row numbers and the byte rows are gathered in that order; or only reorder columns
        in whole blocks (then the blocks of each row are gathered). A slice of the input
        (last) dimension must start and end on block boundaries.

        Raises:
            ValueError: naming the tensor for a non-block type (F32/F16/BF16) or a tensor that is
                not 2-D, a map that is not a row permutation, a slice across a block, or bytes
                that do not unpack.
        """
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        info = self._info
        index = self._index or tuple(slice(0, d) for d in info.shape)
        one_expert = len(info.shape) == 3 and index[0].stop - index[0].start == 1
        if info.tensor_type in ("F32", "F16", "BF16") or not (len(info.shape) == 2 or
                                                              one_expert):
            raise ValueError(f"GGUF tensor {info.name} ({info.tensor_type}, shape "
                             f"{info.shape}) is not a 2-D tensor (or one expert of a 3-D one) "
                             f"of quantized blocks")
        if one_expert and self._transforms:
            raise ValueError(f"GGUF tensor {info.name}: a map of stacked experts cannot apply "
                             f"to quantized blocks")
        block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[info.tensor_type]]
        rows, cols = index[-2:]
        if cols.start % block_size or cols.stop % block_size:
            raise ValueError(f"GGUF tensor {info.name} ({info.tensor_type}): columns "
                             f"[{cols.start}, {cols.stop}) do not fall on {block_size}-weight "
                             f"block boundaries (a tensor-parallel split of the input dimension "
                             f"must); load with quantization='none'")
        try:
            data = tensor_data(self._buffer, info)
        except ValueError as e:
            raise ValueError(f"GGUF tensor {info.name} ({info.tensor_type}) does not unpack: "
                             f"{e}") from e
        if one_expert:
            data = data[index[0].start]
        elif self._transforms:
            data = self._reordered_blocks(data, block_size, block_bytes)
        data = data[rows, cols.start // block_size * block_bytes:
                    cols.stop // block_size * block_bytes]
        return torch.from_numpy(np.array(data, dtype=np.uint8, order="C"))

    def _reordered_blocks(self, data: np.ndarray, block_size: int,
                          block_bytes: int) -> np.ndarray:
        """`data` ([rows, row_bytes] blocks) in the order of this tensor's maps: a row
        permutation, or a permutation of the columns that moves whole blocks (as
        `hybrid_gguf.qwen35_checkpoint_weights` re-orders `ssm_out`'s value heads).

        Raises:
            ValueError: naming the tensor when the maps are neither.
        """
        try:
            return data[self._row_order().numpy()]
        except ValueError as row_error:
            blocks = self._column_block_order(block_size)
            if blocks is None:
                raise row_error from None
        rows = data.shape[0]
        return data.reshape(rows, -1, block_bytes)[:, blocks.numpy()].reshape(rows, -1)

    def _column_block_order(self, block_size: int) -> torch.Tensor | None:
        """The block order of this tensor's maps when they permute columns in whole blocks
        of `block_size`, else None."""
        n = self._info.shape[-1]
        order = torch.arange(n, dtype=torch.float64).unsqueeze(0)
        try:
            for fn in self._transforms:
                order = fn(order)
        except (RuntimeError, IndexError):
            return None
        if order.shape != (1, n) or n % block_size:
            return None
        perm = order.reshape(-1).round().long()
        if not torch.equal(perm.double(), order.reshape(-1)) \
                or not torch.equal(perm.sort().values, torch.arange(n)):
            return None
        blocks = perm.reshape(-1, block_size)
        if not torch.equal(blocks - blocks[:, :1], torch.arange(block_size).expand_as(blocks)) \
                or bool((blocks[:, 0] % block_size).any()):
            return None
        return blocks[:, 0] // block_size

    def _row_order(self) -> torch.Tensor:
        """The row permutation of this tensor's maps, found by mapping the row numbers.

        Raises:
            ValueError: naming the tensor when the maps are not a row permutation.
        """
        n = self._info.shape[0]
        order = torch.arange(n, dtype=torch.float64).unsqueeze(1)
        try:
            for fn in self._transforms:
                order = fn(order)
        except (RuntimeError, IndexError) as e:
            raise ValueError(f"GGUF tensor {self.name}: its map does not apply to rows: "
                             f"{e}") from e
        perm = order.reshape(-1).round().long() if order.shape == (n, 1) else None
        if perm is None or not torch.equal(perm.sort().values, torch.arange(n)) \
                or not torch.equal(perm.double(), order.reshape(-1)):
            raise ValueError(f"GGUF tensor {self.name}: its map is not a row permutation, so "
                             f"it cannot apply to quantized blocks; load with "
                             f"quantization='none'")
        return perm


class GGUFExpert:
    """Expert `expert` of a lazy 3-D GGUF tensor of stacked experts ([experts, rows, cols],
    llama.cpp's `ffn_*_exps`), seen as a lazy 2-D tensor [rows, cols] with GGUFTensor's
    `narrow`, `materialize`, `materialize_raw`, `tensor_type` and `name`: a loader reads that
    expert's bytes only.

    Raises (construction): ValueError for a tensor that is not 3-D or an expert out of range.
    """

    def __init__(self, stacked: GGUFTensor, expert: int) -> None:
        if len(stacked.shape) != 3 or not 0 <= expert < stacked.shape[0]:
            raise ValueError(f"GGUF tensor {stacked.name} {tuple(stacked.shape)}: no expert "
                             f"{expert} of a 3-D tensor of stacked experts")
        self._inner = stacked.narrow(0, expert, 1)
        self.name, self.dtype = f"{stacked.name}[{expert}]", stacked.dtype
        self.shape = torch.Size(self._inner.shape[1:])

    @property
    def tensor_type(self) -> str:
        return self._inner.tensor_type

    def narrow(self, dim: int, start: int, length: int) -> GGUFExpert:
        out = object.__new__(GGUFExpert)
        out._inner = self._inner.narrow(dim % 2 + 1, start, length)
        out.name, out.dtype = self.name, self.dtype
        out.shape = torch.Size(out._inner.shape[1:])
        return out

    def materialize(self) -> torch.Tensor:
        return self._inner.materialize()[0]

    def materialize_raw(self) -> torch.Tensor:
        return self._inner.materialize_raw()


def iterate_gguf_tensors(source: GGUFSource,
                         dtype: torch.dtype) -> Iterator[tuple[str, GGUFTensor]]:
    """Yield (GGUF name, lazy tensor) for every tensor of the file; nothing is dequantized yet.

    The file is memory-mapped once; its tensor table comes from the view (`source.tensors`).

    Raises:
        ValueError: an unsupported tensor type, naming it, before any tensor is yielded.
    """
    check_tensor_types(source.tensors, source.path)
    buffer = np.asarray(np.memmap(source.path, dtype=np.uint8, mode="r"))
    for info in source.tensors:
        yield info.name, GGUFTensor(buffer, info, dtype)


__all__ = ["GGUFExpert", "GGUFSource", "GGUFTensor", "GGUFTensorInfo", "SUPPORTED_TENSOR_TYPES",
           "check_tensor_types", "dequantize", "gguf_cache_root", "is_gguf_path",
           "iterate_gguf_tensors", "metadata_values", "open_gguf", "prepare_gguf_view", "read_gguf_source",
           "tensor_data", "tensor_table"]
