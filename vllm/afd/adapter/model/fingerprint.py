# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The model fingerprint both roles put in their Hello (Hello.fingerprint).

An attention server and an FFN server must run the same model, or the FFN
computes garbage with no error anywhere. model_fingerprint() describes the
model from what both roles have identically: the configuration and the
checkpoint files. Never from live module parameters: the attention role holds
no MLP weights and the FFN role none of the attention weights, so a digest of
either role's modules would always differ.

Items (each a short string; the FFN names every differing one on refusal):

    architecture, model_type, hidden_size, num_hidden_layers, intermediate_size,
    hidden_act, the expert layout the HF config has (num_experts or
    n_routed_experts, num_experts_per_tok, n_shared_experts,
    first_k_dense_replace, moe_intermediate_size, ...), dtype, quantization,
    weights   SHA-256 of the checkpoint's safetensors headers (tensor names,
              dtypes, shapes, offsets) and of its data: all of it for files up
              to FULL_HASH_BYTES, else SAMPLES ranges of SAMPLE_BYTES spread
              evenly over each file's data. Cheap even for huge checkpoints;
              two checkpoints of equal shapes but different training differ
              in every sample. Two large checkpoints that differ only between
              the samples are not told apart.
    series    the vllm-afd patch-series digest (vllm/_afd_vendor.json).

An item one side cannot compute is "unavailable" (wire.FINGERPRINT_UNAVAILABLE)
and never counts as a mismatch: e.g. weights for a hub repo id whose files
are not in the local cache, or a checkpoint without safetensors files.
"""

import functools
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

from vllm.afd.version import SERIES_DIGEST
from vllm.afd.transport.wire import FINGERPRINT_UNAVAILABLE
from vllm.logger import init_logger

logger = init_logger(__name__)

# Config keys describing the FFN's computation, as HF configs name them; the
# ones a config lacks are left out.
CONFIG_KEYS = (
    "hidden_size", "num_hidden_layers", "intermediate_size", "hidden_act",
    # experts: how many, how many per token, shared ones, which layers are dense
    "num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts",
    "num_experts_per_tok", "moe_topk", "n_shared_experts", "shared_expert_intermediate_size",
    "moe_intermediate_size", "first_k_dense_replace", "moe_layer_freq",
    "decoder_sparse_step", "mlp_only_layers", "num_nextn_predict_layers",
    # routing
    "n_group", "topk_group", "topk_method", "scoring_func", "norm_topk_prob",
    "routed_scaling_factor",
)
MAX_VALUE_CHARS = 64  # longer values (layer lists) travel as a digest
FULL_HASH_BYTES = 8 << 20
SAMPLES = 32
SAMPLE_BYTES = 4096
MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit


def model_fingerprint(vllm_config: Any) -> dict[str, str]:
    """The fingerprint of vllm_config's model, identical on both roles."""
    model_config = vllm_config.model_config
    hf_config = model_config.hf_config
    text_config = getattr(model_config, "hf_text_config", None) or hf_config
    items = {
        "architecture": ",".join(getattr(hf_config, "architectures", None) or [])
        or FINGERPRINT_UNAVAILABLE,
        "model_type": _short(getattr(text_config, "model_type", None)
                             or FINGERPRINT_UNAVAILABLE),
    }
    for key in CONFIG_KEYS:
        value = getattr(text_config, key, None)
        if value is not None:
            items[key] = _short(value)
    items["dtype"] = str(model_config.dtype).removeprefix("torch.")
    items["quantization"] = str(getattr(model_config, "quantization", None) or "none")
    items["weights"] = weights_digest(model_config.model,
                                      getattr(model_config, "revision", None))
    items["series"] = SERIES_DIGEST[:16] or FINGERPRINT_UNAVAILABLE
    return items


def _short(value: Any) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, (bool, int, float)):
        text = repr(value)
    else:
        text = json.dumps(value, sort_keys=True, default=str)
    if len(text) > MAX_VALUE_CHARS:
        text = "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return text


def weights_digest(model: str, revision: str | None = None) -> str:
    """Digest of the checkpoint at model (a directory, or a hub repo id found
    in the local cache), or "unavailable"."""
    directory = _checkpoint_dir(model, revision)
    files = _safetensors_files(directory) if directory is not None else []
    if not files:
        logger.info("AFD fingerprint: no safetensors checkpoint found for %s; the weights "
                    "are not compared between the roles", model)
        return FINGERPRINT_UNAVAILABLE
    try:
        stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
        return _digest_files(stamp)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        logger.warning("AFD fingerprint: cannot read the checkpoint of %s (%s); the weights "
                       "are not compared between the roles", model, e)
        return FINGERPRINT_UNAVAILABLE


def _checkpoint_dir(model: str, revision: str | None) -> Path | None:
    if os.path.isdir(model):
        return Path(model)
    try:  # a hub repo id: only what is cached already, never a download
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as e:  # not cached, no hub client, not a repo id...
        logger.debug("AFD fingerprint: %s is not in the local hub cache: %s", model, e)
        return None


def _safetensors_files(directory: Path) -> list[Path]:
    """The files the loader reads: those of the index when there is one
    (a directory may also hold a consolidated copy), else all of them."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
            return [directory / n for n in sorted(names)]
        except (OSError, ValueError, KeyError, AttributeError) as e:
            logger.debug("AFD fingerprint: ignoring unreadable %s: %s", index, e)
    return sorted(directory.glob("*.safetensors"))


@functools.lru_cache(maxsize=8)
def _digest_files(stamp: tuple[tuple[str, int, int], ...]) -> str:
    """Cached by (path, size, mtime) of every file: each connector of a server
    asks, and the files do not change while it runs."""
    digest = hashlib.sha256()
    for path, size, _ in stamp:
        digest.update(Path(path).name.encode() + b"\0")
        with open(path, "rb") as f:
            _digest_file(f, size, digest)
    return digest.hexdigest()[:32]


def _digest_file(f, size: int, digest: "hashlib._Hash") -> None:
    (header_len,) = struct.unpack("<Q", f.read(8))
    if not 0 < header_len <= min(MAX_SAFETENSORS_HEADER, size - 8):
        raise ValueError(f"{f.name}: not a safetensors file (header length {header_len})")
    header = json.loads(f.read(header_len))
    # Canonical form: file metadata and key order are not the weights.
    tensors = sorted((name, info["dtype"], info["shape"], info["data_offsets"])
                     for name, info in header.items() if name != "__metadata__")
    digest.update(json.dumps(tensors).encode())
    data_start = 8 + header_len
    data_len = size - data_start
    digest.update(f"{data_len}\0".encode())
    if data_len <= FULL_HASH_BYTES:
        ranges = [(data_start, data_len)]
    else:
        step = (data_len - SAMPLE_BYTES) / (SAMPLES - 1)
        ranges = [(data_start + int(i * step), SAMPLE_BYTES) for i in range(SAMPLES)]
    for offset, length in ranges:
        f.seek(offset)
        while length:
            chunk = f.read(min(length, 1 << 20))
            if not chunk:
                raise ValueError(f"{f.name}: truncated at byte {f.tell()}")
            digest.update(chunk)
            length -= len(chunk)
