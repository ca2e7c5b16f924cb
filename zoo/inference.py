"""Using a trained model from Python: sample video, generate text, predict a protein, forecast.

::

    from dspzoo.zoo import inference

    clips = inference.sample_video("stdit-mini-shapes", per_class=1, steps=20)
    clips.video                                   # [N, 3, T, H, W] pixels in [-1, 1]
    inference.generate_text("bytelm-tiny-stdlib", "def ", max_new=80).text
    pred = inference.predict_protein("evoformer-small-pdb", "MKTAYIAK...", msas=["hits.a3m"])
    pred.contact_probs                            # [R, R]
    fc = inference.forecast_weather("weathertx-small-a1b-e1", steps=20)
    fc.forecast.rmse["model"]                     # [steps, C]

Every function takes a shipped model's name (``dspzoo list --pretrained``), a folder written by
``save_pretrained`` (a training run's ``<output-dir>/final``), or a :class:`LoadedModel` from
:func:`load` (load once, use many times); the settings a training run saved beside the weights
(video frames and codec, the weather data and its statistics, protein recycles) are the
defaults. A model of another family is refused with a ``ValueError`` naming both.

**Sequence parallelism.** Pass ``sp``, the :class:`~dspzoo.core.parallel.runtime.SeqParallel`
of a mesh (``accelerator, mesh, sp = dspzoo.core.accelerate.setup_accelerate(sp_size)`` under
``accelerate launch``): the model then runs sharded over the SP group; every rank of the group
calls the function with the same arguments and gets the same result. Without ``sp`` it runs in
this process alone. Text generation runs on one process (a ByteLM decodes with a KV cache, a
Mamba LM with one recurrent step per byte, the hybrid LM with both).

The command-line tools — ``dspzoo sample|generate|predict|forecast`` and the scripts behind
them (``scripts/sample_video.py``, ``generate_text.py``, ``predict_protein.py``,
``forecast_weather.py``) — parse flags, call these functions and write files.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..core.errors import UsageError

VIDEO_FAMILIES = ("stdit", "latte", "videomamba")
TEXT_FAMILIES = ("bytelm", "mambalm", "mamba2lm", "hybridlm")
WEATHER_FAMILIES = ("weathertx", "weathermamba")


@dataclass
class LoadedModel:
    """A model rebuilt from a folder, in eval mode, with what was saved beside its weights.

    Attributes:
        model: the model (on the device :func:`load` was given).
        folder: the folder it came from (a shipped model's folder for a name).
        family: its zoo family (``"stdit"``, ``"bytelm"``, ``"evoformer"``, ``"weathertx"``…).
        extra: the ``extra`` dict of its ``config.json`` (training settings and figures).
    """

    model: nn.Module
    folder: Path
    family: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


ModelRef = str | os.PathLike | LoadedModel


def load(
    ref: str | os.PathLike,
    family: str | tuple[str, ...] | None = None,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Load a shipped model's name or a ``save_pretrained`` folder (eval mode, on ``device``).

    ``family``: the family (or families) the caller can use; another raises ``ValueError``.
    A missing folder or unknown name raises ``FileNotFoundError`` listing the shipped names.
    A ``device`` that is not one, or that this machine lacks (``"cuda"`` without a GPU), raises
    ``ValueError`` before anything is read (:func:`~dspzoo.zoo.pretrained.check_device`).
    """
    from .pretrained import _read_meta, check_device, from_pretrained, load_extra
    from .shipped import resolve_pretrained

    device = check_device(device)
    folder = resolve_pretrained(ref)
    saved = _read_meta(folder)["family"]
    _check_family(saved, family, folder)
    model = from_pretrained(folder, device=device).eval()
    return LoadedModel(model, folder, saved, load_extra(folder))


def default_output_folder(model_ref: str | os.PathLike) -> Path:
    """Where a command writes what it made from ``model_ref`` when given no ``--out``: beside
    a folder's model (its parent folder, as training lays out ``<run>/final``), or
    ``outputs/<name>`` for a shipped name — never the working directory itself."""
    folder = Path(model_ref)
    if folder.is_dir():
        return folder.resolve().parent
    return Path("outputs") / folder.name


def _check_family(saved: str, wanted: str | tuple[str, ...] | None, where: Any) -> None:
    allowed = (wanted,) if isinstance(wanted, str) else wanted
    if allowed is not None and saved not in allowed:
        raise UsageError(f"{where} holds a {saved!r} model; this takes {list(allowed)} models")


def _loaded(ref: ModelRef, family: str | tuple[str, ...], device: Any = None) -> LoadedModel:
    if isinstance(ref, LoadedModel):
        _check_family(ref.family, family, ref.folder)
        return ref
    return load(ref, family, device or "cpu")


def _single_process_sp() -> Any:
    from ..core.parallel.runtime import SeqParallel

    return SeqParallel()


# -- video --------------------------------------------------------------------------------------
@dataclass
class VideoSamples:
    """Sampled clips.

    Attributes:
        video: ``[N, 3, T, H, W]`` pixels in ``[-1, 1]`` (decoded latents).
        latents: ``[N, C, T, H / f, W / f]`` what the model denoised (``f``: the codec factor).
        labels: ``[N]`` class label of each clip (``None`` for an unconditional model).
        seconds: wall time of the denoising loop on this rank.
    """

    video: torch.Tensor
    latents: torch.Tensor
    labels: torch.Tensor | None
    seconds: float


def sample_video(
    model: ModelRef,
    *,
    per_class: int = 2,
    labels: torch.Tensor | None = None,
    steps: int = 30,
    guidance: float = 2.0,
    frames: int | None = None,
    size: int | None = None,
    seed: int = 0,
    sp: Any = None,
    progress: bool = False,
) -> VideoSamples:
    """Sample clips from a video DiT (STDiT, Latte, the video Mamba DiT) by integrating its
    learned velocity.

    ``labels`` ``[N]`` picks the clips' classes (default: ``per_class`` clips of every class);
    ``guidance`` is the classifier-free guidance scale (1: none). ``frames`` and ``size``
    (pixels) default to the settings saved with the model. The noise comes from ``seed``
    alone, so one process and any SP size give the same clips.
    """
    from dspzoo.domains.video.codec import PixelUnshuffleCodec

    loaded = _loaded(model, VIDEO_FAMILIES)
    if steps < 1 or per_class < 1:
        raise UsageError(f"steps and per_class must be >= 1, got {steps} and {per_class}")
    settings = loaded.extra.get("sampling", {})
    if not settings and (frames is None or size is None):
        raise UsageError(
            f"{loaded.folder} holds no sampling settings (frames, size, codec; training saves "
            f"them with the final model): give frames and size"
        )
    frames = frames or settings["frames"]
    size = size or settings["size"]
    codec = PixelUnshuffleCodec(settings.get("codec_factor", 2))
    config = loaded.model.config
    pt, ph, pw = getattr(config, "patch", (1, 1, 1))
    side = math.lcm(ph, pw)
    step = codec.factor * side  # pixels per patch side, through the codec
    if size % step:
        raise UsageError(
            f"size {size} px does not fit this model: it must be a multiple of {step} (the "
            f"codec's factor {codec.factor} times the patch side {side}), e.g. "
            f"{max(step, size // step * step)}"
        )
    if frames % pt:
        raise UsageError(f"frames {frames} must be a multiple of the temporal patch {pt}")
    if labels is None:
        labels = torch.arange(max(1, config.num_classes)).repeat_interleave(per_class)
    shape = (len(labels), config.in_channels, frames, size // codec.factor, size // codec.factor)
    result = _video_sampler(loaded.family)(
        loaded.model,
        sp if sp is not None else _single_process_sp(),
        shape,
        steps=steps,
        labels=labels if config.num_classes else None,
        guidance=guidance,
        seed=seed,
        progress=progress,
    )
    video = codec.decode(result.latents.float().cpu()).clamp(-1, 1)
    return VideoSamples(
        video, result.latents, labels if config.num_classes else None, result.seconds
    )


def _video_sampler(family: str) -> Any:
    """The Euler sampler for a video family: the DiTs' (token layout ``(t, s)``) or the video
    Mamba DiT's (:mod:`dspzoo.domains.mamba.sampling`); both take the same arguments."""
    if family == "videomamba":
        from dspzoo.domains.mamba.sampling import sample_video
    else:
        from dspzoo.domains.video.sampling import sample_video
    return sample_video


# -- text ---------------------------------------------------------------------------------------
@dataclass
class GeneratedText:
    """A prompt and its continuation.

    Attributes:
        prompt, new: the prompt's bytes and the generated ones.
        seconds: wall time of the generation.
        trained_length: the byte windows the model was trained on (``None``: not recorded).
    """

    prompt: bytes
    new: bytes
    seconds: float
    trained_length: int | None = None

    @property
    def text(self) -> str:
        """Prompt and continuation as UTF-8 (undecodable bytes replaced)."""
        return (self.prompt + self.new).decode("utf-8", errors="replace")

    @property
    def beyond_training(self) -> bool:
        """Whether the text is longer than the windows the model was trained on."""
        return bool(self.trained_length) and len(self.prompt) + len(self.new) > self.trained_length


def generate_text(
    model: ModelRef,
    prompt: str | bytes,
    max_new: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
) -> GeneratedText:
    """Continue ``prompt`` by ``max_new`` bytes with a byte LM (one process): a ``bytelm``
    (KV cache), a byte-level Mamba LM, ``mambalm`` / ``mamba2lm`` (prompt prefilled, then one
    recurrent step per byte: :mod:`dspzoo.domains.mamba.generate`), or the hybrid ``hybridlm``
    (the same, with a KV cache in its attention layers).

    ``temperature`` 0 always takes the likeliest byte; ``top_k`` samples among the k likeliest
    (``None`` or 0: all). The draws come from a generator seeded with ``seed``.
    """
    loaded = _loaded(model, TEXT_FAMILIES)
    prompt = prompt.encode("utf-8") if isinstance(prompt, str) else bytes(prompt)
    if not prompt or max_new < 0 or temperature < 0 or (top_k or 0) < 0:
        raise UsageError(
            "generate_text needs a non-empty prompt and max_new, temperature, top_k >= 0"
        )
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    if loaded.family == "bytelm":
        new = loaded.model.generate(prompt, max_new, temperature, top_k or None, generator)
    else:
        from dspzoo.domains.mamba.generate import generate_bytes

        new = generate_bytes(loaded.model, prompt, max_new, temperature, top_k or None, generator)
    seconds = time.perf_counter() - start
    trained = loaded.extra.get("training", {}).get("seq_len")
    return GeneratedText(prompt, new, seconds, trained)


# -- protein ------------------------------------------------------------------------------------
@dataclass
class ProteinPrediction:
    """A predicted distogram and contact map.

    Attributes:
        sequence: the query (one-letter codes).
        residue_index: ``[R]``.
        distogram: ``[R, R, bins]`` probabilities over the distance bins.
        boundaries: ``[bins - 1]`` bin edges in Å.
        contact_probs: ``[R, R]`` probability of a Cβ–Cβ distance below 8 Å.
    """

    sequence: str
    residue_index: np.ndarray
    distogram: np.ndarray
    boundaries: np.ndarray
    contact_probs: np.ndarray


def predict_protein(
    model: ModelRef,
    sequence: str,
    msas: list[str] | tuple[str, ...] = (),
    *,
    sp: Any = None,
    num_recycles: int | None = None,
    max_msa_rows: int | None = None,
) -> ProteinPrediction:
    """Predict the distogram and contact map of ``sequence`` with an Evoformer model.

    ``msas``: paths of ``.a3m`` / ``.sto`` alignments whose first row is the query.
    ``num_recycles`` defaults to the model's training setting; ``max_msa_rows``: use the first
    rows only (default: all, after deduplication).
    """
    from dspzoo.domains.protein.predict import predict, prediction_sample

    loaded = _loaded(model, "evoformer")
    sample = prediction_sample(sequence, list(msas))
    if num_recycles is None:
        num_recycles = loaded.extra.get("protein", {}).get("num_recycles")
    sharded = sp if sp is not None and sp.size > 1 else None
    out = predict(loaded.model, sample, sharded, num_recycles, max_msa_rows)
    return ProteinPrediction(
        sequence, sample["residue_index"], out["distogram"], out["boundaries"], out["contact_probs"]
    )


# -- weather ------------------------------------------------------------------------------------
@dataclass
class WeatherForecast:
    """An autoregressive rollout and the data it started from.

    Attributes:
        forecast: the :class:`~dspzoo.domains.weather.forecast.Forecast` (forecast, truth,
            persistence, climatology ``[steps, C, lat, lon]`` in physical units, RMSE per lead).
        data: the data set (grid, channels, times) it was scored on.
        lead: time steps per forecast step.
        init: the initial time.
        trajectory: the trajectory's name.
    """

    forecast: Any
    data: Any
    lead: int
    init: str
    trajectory: str

    def summary(self) -> dict[str, Any]:
        """``{"init", "trajectory", "leads", "rmse": {name: [steps][C] or None}}`` (JSON)."""
        rmse = self.forecast.rmse
        return {
            "init": self.init,
            "trajectory": self.trajectory,
            "leads": self.forecast.leads.tolist(),
            "rmse": {k: np.where(np.isnan(v), None, v).tolist() for k, v in rmse.items()},
        }


def forecast_weather(
    model: ModelRef,
    *,
    steps: int = 20,
    init_year: int | None = None,
    trajectory: int = 0,
    lead: int | None = None,
    data: str | None = None,
    sp: Any = None,
) -> WeatherForecast:
    """Roll a weather model out ``steps`` times from the data it was trained on.

    The initial state is the last time step of ``init_year`` (default: the last training time,
    so the forecast runs into the held-out years) of trajectory ``trajectory``; ``data``
    replaces the source (e.g. ``"e1"``, another scenario on the same grid). ``lead`` (time
    steps per forecast step) defaults to the shortest lead trained. Every step is scored
    against the truth, persistence and climatology.
    """
    from dspzoo.domains.weather.data import WeatherDataError, held_out_times
    from dspzoo.domains.weather.forecast import forecast_from
    from dspzoo.domains.weather.training import data_from_extra

    loaded = _loaded(model, WEATHER_FAMILIES)
    if steps < 1:
        raise UsageError(f"steps must be >= 1, got {steps}")
    extra = dict(loaded.extra)
    if "weather" not in extra:
        raise WeatherDataError(f"{loaded.folder}: no 'weather' settings in its config.json extra")
    if data:
        extra["weather"] = {**extra["weather"], "data": data}
    dataset = data_from_extra(extra)
    window, fields = dataset.window, dataset.fields
    lead = lead or min(window.leads)
    if init_year is None:  # the last training time (the hold-out may begin mid-year)
        matches = np.flatnonzero(~held_out_times(fields, window))
        if matches.size == 0:
            raise WeatherDataError("no time before the held-out times to start the forecast at")
    else:
        matches = np.flatnonzero(fields.years == init_year)
        if matches.size == 0:
            raise WeatherDataError(
                f"initial year {init_year} is not in the data "
                f"({fields.years.min()}–{fields.years.max()})"
            )
    t0 = int(matches[-1])
    model_fp32 = loaded.model.float().eval()
    with torch.no_grad():
        fc = forecast_from(model_fp32, dataset, trajectory, t0, steps, lead, sp)
    return WeatherForecast(fc, dataset, lead, str(fields.times[t0]), fields.names[trajectory])
