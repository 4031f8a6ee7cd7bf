"""Which checkpoint tensors the codec's encoder is made of, strictly, from the same files as the decoder.

Layouts (read by ``decoder_load.read_checkpoint`` / ``tensors_of``, the ``generator.`` prefix removed):
- the release's Lightning checkpoint: ``encoder.*`` as DAC's weight-normed modules (``weight_g`` /
  ``weight_v``, or torch's newer ``parametrizations.weight.original0/1``), and per level
  ``quantizer.vq_layer_{i}._codebook.embed``, the codebook the reference's quantizer picks codes
  from (``EuclideanCodebook.quantize``) and decodes with (``decoder_load.py`` says why that tensor and
  not its alias ``quantizer.embed_{i}``);
- the project's tiny set: ``encoder.*`` the same way, codebooks ``quantizer.quantizers.{i}.codebook.weight``;
- DAC's own files: their quantizer projects and normalises before it looks up a code, which this
  encoder does not do: refused.

Weight norm: the reference's modules compute ``torch._weight_norm(v, g, 0)`` at every forward (the op
behind ``torch.nn.utils.weight_norm``); it is applied here once, so the weights are those bits, not
a fold of our own that differs in the last place (a near-tie between two codes can turn on that).
A missing key, a left-over ``encoder.*`` key or a wrong shape refuses with one line naming it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from songserve.errors import ConfigError
from songserve.pipeline.checkpoints.decoder_load import read_checkpoint, tensors_of

log = logging.getLogger(__name__)
_OWN_BOOK = "quantizer.quantizers.{i}.codebook.weight"
_RELEASE_BOOK = "quantizer.vq_layer_{i}._codebook.embed"
_PAIRS = ((".weight_g", ".weight_v"), (".parametrizations.weight.original0", ".parametrizations.weight.original1"))


def encoder_tensors(
    targets: dict[str, torch.Size], n_codebooks: int, path: Path, config: Path, *, trust_pickle: bool = False
) -> dict[str, torch.Tensor]:
    """The tensor for every name in ``targets`` (the encoder's ``encoder.*`` parameters, plus
    ``codebooks``: (n_q, size, dim)), weight norm applied; ``ConfigError`` for the first mismatch."""
    raw, _ = read_checkpoint(path, trust_pickle=trust_pickle)
    if isinstance(raw, dict) and "metadata" in raw and "state_dict" in raw:
        raise ConfigError(
            f"Decoder checkpoint {path} is in DAC's own format, whose quantizer this encoder does not run."
        )
    state = tensors_of(raw, path)

    def missing(key: str) -> ConfigError:
        return ConfigError(f"Decoder checkpoint {path} has no encoder for {config}: it lacks 'generator.{key}'.")

    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    for name, shape in targets.items():
        if name == "codebooks":
            continue
        if name in state:
            t = state[name].float()
            used.add(name)
        else:
            base = name.removesuffix(".weight")
            pair = next(((base + g, base + v) for g, v in _PAIRS if base + v in state), None)
            if not name.endswith(".weight") or pair is None:
                raise missing(f"{base}.weight_v" if name.endswith(".weight") else name)
            if pair[0] not in state:
                raise missing(pair[0])
            g, v = state[pair[0]].float(), state[pair[1]].float()
            if v.shape != shape or g.numel() != shape[0]:
                raise _shape(path, config, pair[1], tuple(v.shape), tuple(shape))
            t = torch._weight_norm(v, g.reshape(-1, *([1] * (v.dim() - 1))), 0)
            used.update(pair)
        if t.shape != shape:
            raise _shape(path, config, name, tuple(t.shape), tuple(shape))
        out[name] = t
    extra = sorted(k for k in state if k.startswith("encoder.") and k not in used)
    if extra:
        raise ConfigError(
            f"Decoder checkpoint {path} does not match {config}: it has the key 'generator.{extra[0]}', "
            f"which the config's encoder does not use ({len(extra)} such keys)."
        )
    release = _RELEASE_BOOK.format(i=0) in state
    pattern = _RELEASE_BOOK if release else _OWN_BOOK
    books = []
    for i in range(n_codebooks):
        key = pattern.format(i=i)
        if key not in state:
            raise missing(key)
        books.append(state[key].float())
    codebooks = torch.stack(books)
    if codebooks.shape != targets["codebooks"]:
        raise _shape(path, config, pattern.format(i=0), tuple(books[0].shape), tuple(targets["codebooks"][1:]))
    if release:
        _warn_if_uninitialised(state, n_codebooks, path)
    out["codebooks"] = codebooks
    return out


def _shape(path: Path, config: Path, key: str, got: tuple[int, ...], want: tuple[int, ...]) -> ConfigError:
    return ConfigError(
        f"Decoder checkpoint {path} does not match {config}: 'generator.{key}' has shape {got}, "
        f"the config's encoder needs {want}."
    )


def _warn_if_uninitialised(state: dict[str, torch.Tensor], n: int, path: Path) -> None:
    """The reference's quantizer forward runs k-means on its input when a level's ``inited`` is 0 (and
    overwrites that codebook): a trained file never says 0, and we always encode with the stored books."""
    for i in range(n):
        flag = state.get(f"quantizer.vq_layer_{i}._codebook.inited")
        if flag is not None and not bool(flag.reshape(-1)[0]):
            log.warning("decoder checkpoint %s: level %d's codebook says inited=0; encoding with it as stored", path, i)
            return
