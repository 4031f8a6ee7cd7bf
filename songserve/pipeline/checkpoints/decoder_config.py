"""The decoder's configuration, read from either YAML schema the project meets.

- the published release's schema (``models/Decoder/dac_rvq_1024_64_golden.yaml``)::

      encoder:   {input_channel, n_filters, strides, d_latent}
      decoder:   {d_latent, n_filters, rates, out_channel}
      quantizer: {dim: ${encoder.d_latent}, codebook_size, num_quantizers, decay, q_dropout}

  read as the reference's own code reads it (``RELEASE_KEYS`` says how), with OmegaConf-style ``${a.b}`` interpolation, resolved here by a small resolver (omegaconf is
  not a dependency for one feature);
- the project's own schema (``latent_dim``, ``upsampling_ratios``, ``n_codebooks``, …), which the
  default tiny set writes.

A missing or bad field refuses with one line naming the file and the dotted key.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from songserve.errors import ConfigError
from songserve.pipeline.numbers import CODEBOOK, SAMPLE_RATE, SUPERRES_LEVELS

_REF = re.compile(r"\$\{([^${}]+)\}")

# The release's schema is the keyword arguments of the reference's constructors, as its
# ``DacRVQ.__init__`` (models/Decoder/dac_rvq.py) passes them: ``Encoder(**configs['encoder'])``,
# ``Decoder(**configs['decoder'])``, then ``configs['quantizer'].pop('q_dropout')`` and
# ``ResidualVectorQuantization(num_quantizers, **rest)`` → ``VectorQuantization(**rest)`` (rvq.py).
# So a section must exist, a key outside these lists is a TypeError there (refused here), a key
# with a default there may be absent, and ``q_dropout`` must be present (``pop`` has no default) but
# may hold anything: ``DacRVQ.forward`` reads it only while training (``self.training and
# self.q_dropout``), so the release's ``q_dropout: False`` and a count such as 64 both load. The
# training-only quantizer arguments (decay, epsilon, k-means, dead-code threshold, losses) are not
# checked, as the reference does not check them either.
RELEASE_KEYS: dict[str, tuple[str, ...]] = {
    "encoder": ("input_channel", "n_filters", "strides", "d_latent"),
    "decoder": ("d_latent", "n_filters", "rates", "out_channel"),
    "quantizer": (
        "num_quantizers",
        "q_dropout",
        "dim",
        "codebook_size",
        "codebook_dim",
        "decay",
        "epsilon",
        "kmeans_init",
        "kmeans_iters",
        "threshold_ema_dead_code",
        "channels_last",
        "commitment_weight",
        "orthogonal_reg_weight",
        "orthogonal_reg_active_codes_only",
        "orthogonal_reg_max_codes",
    ),
}
RELEASE_BUILDERS = {
    "encoder": "Encoder (dac.py)",
    "decoder": "Decoder (dac.py)",
    "quantizer": "ResidualVectorQuantization / VectorQuantization (rvq.py)",
}


@dataclass(frozen=True)
class DecoderConfig:
    sample_rate: int = SAMPLE_RATE
    latent_dim: int = 128
    n_filters: int = 192  # decoder's first conv has n_filters · 2^len(rates) channels
    rates: tuple[int, ...] = (8, 8, 8, 4)
    channels: int = 2
    n_codebooks: int = SUPERRES_LEVELS
    codebook_size: int = CODEBOOK
    codebook_dim: int | None = None  # DAC's factorised codebooks (with out_proj); None = latent_dim
    final_tanh: bool = False

    @property
    def hop(self) -> int:
        return math.prod(self.rates)

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.hop

    def to_yaml_dict(self) -> dict[str, Any]:
        """The project's schema (what the default tiny set writes)."""
        return {
            "sample_rate": self.sample_rate,
            "encoder": {
                "n_filters": self.n_filters // 2,
                "latent_dim": self.latent_dim,
                "strides": list(reversed(self.rates)),
                "input_channel": self.channels,
            },
            "decoder": {
                "n_filters": self.n_filters,
                "upsampling_ratios": list(self.rates),
                "output_channels": self.channels,
                "final_tanh": self.final_tanh,
            },
            "quantizer": {
                "n_codebooks": self.n_codebooks,
                "codebook_size": self.codebook_size,
                "latent_dim": self.latent_dim,
            },
        }

    @classmethod
    def from_yaml_dict(cls, raw: dict[str, Any], source: str) -> DecoderConfig:
        """Either schema; the release's is recognised by its ``decoder.rates`` / ``quantizer.num_quantizers``."""
        if not isinstance(raw, dict):
            raise ConfigError(f"Decoder config {source} is not a mapping.")
        resolved = resolve_interpolations(raw, source)
        f = _Fields(resolved, source)
        dec, q = f.section("decoder"), f.section("quantizer")
        if "rates" in dec or "num_quantizers" in q:
            return cls._from_release(f)
        return cls(
            sample_rate=f.integer("sample_rate", SAMPLE_RATE),
            latent_dim=f.integer("quantizer.latent_dim"),
            n_filters=f.integer("decoder.n_filters"),
            rates=f.int_list("decoder.upsampling_ratios"),
            channels=f.integer("decoder.output_channels", 2),
            n_codebooks=f.integer("quantizer.n_codebooks"),
            codebook_size=f.integer("quantizer.codebook_size"),
            codebook_dim=f.integer("quantizer.codebook_dim", 0) or None,
            final_tanh=f.boolean("decoder.final_tanh", False),
        )

    @classmethod
    def _from_release(cls, f: _Fields) -> DecoderConfig:
        """Read as the reference's ``DacRVQ(configs)`` reads it (see ``RELEASE_KEYS``)."""
        for section, keys in RELEASE_KEYS.items():
            unknown = sorted(set(map(str, f.section(section))) - set(keys))
            if unknown:
                raise ConfigError(
                    f"Decoder config {f.source}: key '{section}.{unknown[0]}' is not an argument of the reference's "
                    f"{RELEASE_BUILDERS[section]} (it takes {', '.join(keys)})."
                )
        f.present("quantizer.q_dropout")
        # Encoder widths: the reference's Encoder defaults where a key is absent (built only to encode).
        f.integer("encoder.input_channel", 2)
        f.integer("encoder.n_filters", 128)
        f.int_list("encoder.strides", (2, 4, 8, 8))
        f.integer("encoder.d_latent", 64)
        d_latent = f.integer("decoder.d_latent")
        dim = f.integer("quantizer.dim")
        if dim != d_latent:
            raise ConfigError(
                f"Decoder config {f.source}: key 'quantizer.dim' ({dim}) must equal 'decoder.d_latent' ({d_latent})."
            )
        # codebook_dim ≠ dim gives each VQ layer project_in/project_out Linear layers (rvq.py); the
        # release has none, and this decoder does not build them.
        codebook_dim = f.integer("quantizer.codebook_dim", dim)
        if codebook_dim != dim:
            raise ConfigError(
                f"Decoder config {f.source}: key 'quantizer.codebook_dim' ({codebook_dim}) differs from "
                f"'quantizer.dim' ({dim}); projected codebooks are not supported."
            )
        if f.present("quantizer.channels_last", False) is True:
            raise ConfigError(
                f"Decoder config {f.source}: key 'quantizer.channels_last' is true; the reference's DacRVQ "
                "passes channels-first latents, so only false is supported."
            )
        return cls(
            latent_dim=d_latent,
            n_filters=f.integer("decoder.n_filters"),
            rates=f.int_list("decoder.rates"),
            channels=f.integer("decoder.out_channel", 2),
            n_codebooks=f.integer("quantizer.num_quantizers"),
            codebook_size=f.integer("quantizer.codebook_size"),
            final_tanh=False,  # dac.py's Decoder ends at its last conv: its nn.Tanh() is commented out
        )

    @classmethod
    def from_dac_kwargs(cls, kw: dict[str, Any]) -> DecoderConfig:
        """DAC's own files: their metadata's keyword arguments, with DAC's defaults (not this model's numbers)."""
        rates = tuple(kw.get("decoder_rates", (8, 8, 4, 2)))
        return cls(
            sample_rate=int(kw.get("sample_rate", 44100)),
            latent_dim=int(
                kw.get("latent_dim") or kw.get("encoder_dim", 64) * 2 ** len(kw.get("encoder_rates", (2, 4, 8, 8)))
            ),
            n_filters=int(kw.get("decoder_dim", 1536)) // 2 ** len(rates),
            rates=rates,
            channels=1,
            n_codebooks=int(kw.get("n_codebooks", 9)),
            codebook_size=int(kw.get("codebook_size", 1024)),
            codebook_dim=int(kw.get("codebook_dim", 8)),
            final_tanh=True,
        )


def read_decoder_yaml(path: Path) -> Any:
    """A decoder YAML file's contents (the decoder's and the encoder's config read it), or a
    ``ConfigError`` naming the path."""
    import yaml

    if not path.is_file():
        raise ConfigError(f"Decoder config {path} does not exist.")
    try:
        return yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"Decoder config {path} is not valid YAML: {first}") from None


def read_decoder_config(path: Path) -> DecoderConfig:
    """Read and validate a decoder YAML file (either schema)."""
    return DecoderConfig.from_yaml_dict(read_decoder_yaml(path), str(path))


# ---- ${a.b} interpolation ---------------------------------------------------------------------


def resolve_interpolations(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Replace ``${a.b}`` by the value at that dotted key (whole-string references keep their type)."""

    def lookup(dotted: str, at: str, seen: tuple[str, ...]) -> Any:
        if dotted in seen:
            raise ConfigError(f"Decoder config {source}: key '{at}' has a circular reference ${{{dotted}}}.")
        node: Any = raw
        for part in dotted.strip().split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"Decoder config {source}: key '{at}' refers to ${{{dotted}}}, which does not exist.")
            node = node[part]
        return resolve(node, dotted, (*seen, dotted))

    def resolve(node: Any, at: str, seen: tuple[str, ...]) -> Any:
        if isinstance(node, dict):
            return {k: resolve(v, f"{at}.{k}" if at else str(k), seen) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v, f"{at}[{i}]", seen) for i, v in enumerate(node)]
        if not isinstance(node, str) or "${" not in node:
            return node
        whole = _REF.fullmatch(node)
        if whole:
            return lookup(whole.group(1), at, seen)
        return _REF.sub(lambda m: str(lookup(m.group(1), at, seen)), node)

    resolved: dict[str, Any] = resolve(raw, "", ())
    return resolved


class _Fields:
    """Typed access by dotted key, each failure one line naming the file and the key."""

    _MISSING = object()

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def _get(self, dotted: str, default: Any) -> Any:
        node: Any = self.raw
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node or node[part] is None:
                if default is not self._MISSING:
                    return default
                raise ConfigError(f"Decoder config {self.source} is missing the key '{dotted}'.")
            node = node[part]
        return node

    def _bad(self, dotted: str, want: str, value: Any) -> ConfigError:
        return ConfigError(f"Decoder config {self.source}: key '{dotted}' must be {want} (got {value!r}).")

    def section(self, name: str) -> dict[str, Any]:
        value = self._get(name, self._MISSING)
        if not isinstance(value, dict):
            raise self._bad(name, "a mapping", value)
        return value

    def integer(self, dotted: str, default: Any = _MISSING) -> int:
        value = self._get(dotted, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self._bad(dotted, "a non-negative integer", value)
        return value

    def number(self, dotted: str, default: Any = _MISSING) -> float:
        value = self._get(dotted, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._bad(dotted, "a number", value)
        return float(value)

    def boolean(self, dotted: str, default: Any = _MISSING) -> bool:
        value = self._get(dotted, default)
        if not isinstance(value, bool):
            raise self._bad(dotted, "true or false", value)
        return value

    def present(self, dotted: str, default: Any = _MISSING) -> Any:
        """The value, of any type, ``None`` included (for keys the reference only requires to exist)."""
        parent, _, key = dotted.rpartition(".")
        node = self._get(parent, self._MISSING) if parent else self.raw
        if isinstance(node, dict) and key in node:
            return node[key]
        if default is not self._MISSING:
            return default
        raise ConfigError(f"Decoder config {self.source} is missing the key '{dotted}'.")

    def int_list(self, dotted: str, default: Any = _MISSING) -> tuple[int, ...]:
        value = self._get(dotted, default)
        if isinstance(value, tuple):
            return value
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
        ):
            raise self._bad(dotted, "a list of positive integers", value)
        return tuple(value)
