"""``splitserve plan``: the arithmetic of disaggregation for a model, GPU, link and workload.

Runs in the CLI process. The only module of the planner that prints (``click.echo``); every
bad input ends in one line, ``Error: <what was wrong, naming the input>``, exit status 1, never
a stack trace. ``--calibrate`` imports torch and NIXL (``splitserve.planner.calibrate``) only
when asked.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import click
from pydantic import ValidationError

from splitserve.planner.calibration_file import LoadedCalibration, load_calibration
from splitserve.planner.catalog import (
    ACCELERATORS,
    LINKS,
    MODELS,
    Accelerator,
    Link,
    ModelShape,
    PlannerInputError,
    custom_link,
    explain_validation,
    get_accelerator,
    get_link,
    get_model,
)
from splitserve.planner.kv import KV_DTYPE_BYTES
from splitserve.planner.phases import PhaseHardware
from splitserve.planner.plan import Plan, auto_gpus_per_replica, make_plan
from splitserve.planner.pools import Slo, Workload
from splitserve.planner.report import render_json, render_text

if TYPE_CHECKING:  # calibrate imports torch and NIXL: only when --calibrate asks
    from splitserve.planner.calibrate import CalibrationResult

logger = logging.getLogger(__name__)

WEIGHT_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
_POSITIVE = click.FloatRange(min=0, min_open=True)


class _OneLineErrors(click.Command):
    """Report bad options as one ``Error:`` line (click's usage errors print three)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            if ctx.resilient_parsing:
                raise
            raise click.ClickException(e.format_message()) from None


def model_options(command):
    """``--model``, ``--kv-dtype`` and ``--weight-dtype`` as ``plan`` and ``simulate`` take them."""
    options = [
        click.option(
            "--model",
            "model_name",
            required=True,
            metavar="NAME|CONFIG",
            help=f"Catalog model ({', '.join(MODELS)}) or a Hugging Face config.json path.",
        ),
        click.option(
            "--kv-dtype",
            default="bf16",
            show_default=True,
            type=click.Choice(sorted(KV_DTYPE_BYTES), case_sensitive=False),
        ),
        click.option(
            "--weight-dtype",
            default="bf16",
            show_default=True,
            type=click.Choice(sorted(WEIGHT_DTYPE_BYTES), case_sensitive=False),
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@click.command(cls=_OneLineErrors)
@model_options
@click.option(
    "--gpu",
    default="H100",
    show_default=True,
    metavar="NAME",
    help=f"Accelerator: {', '.join(ACCELERATORS)}.",
)
@click.option(
    "--gpus-per-replica",
    type=click.IntRange(min=1),
    help="GPUs per replica (tensor parallel); default: fewest that hold the weights.",
)
@click.option(
    "--efficiency",
    type=click.FloatRange(0, 1, min_open=True),
    default=1.0,
    show_default=True,
    help="Share of peak FLOP/s and memory bandwidth achieved.",
)
@click.option(
    "--link",
    "link_name",
    default="NVLink4",
    show_default=True,
    metavar="NAME",
    help=f"KV link: {', '.join(LINKS)}.",
)
@click.option("--link-gbps", type=_POSITIVE, help="A custom link of this many GB/s (1e9 B/s).")
@click.option("--prefill-gpu", metavar="NAME", help="Prefill pool's accelerator (default --gpu).")
@click.option("--decode-gpu", metavar="NAME", help="Decode pool's accelerator (default --gpu).")
@click.option("--prefill-gpus-per-replica", type=click.IntRange(min=1))
@click.option("--decode-gpus-per-replica", type=click.IntRange(min=1))
@click.option(
    "--price",
    "price_items",
    multiple=True,
    metavar="GPU=DOLLARS",
    help="Dollars per GPU-hour for the per-pool comparison (default: the catalog's).",
)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--output-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--rate", type=_POSITIVE, help="Requests per second (enables replica counts).")
@click.option("--ttft-ms", type=_POSITIVE, help="Time-to-first-token target [default 2000].")
@click.option("--itl-ms", type=_POSITIVE, help="Inter-token latency target [default 50].")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option(
    "--calibrate",
    is_flag=True,
    help="Measure this machine (torch layer timing, NIXL bandwidth) and plan with it.",
)
@click.option(
    "--calibrate-device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
)
@click.option(
    "--calibrate-tokens",
    default="128,512",
    show_default=True,
    help="Comma-separated prompt lengths to time one layer at.",
)
@click.option(
    "--calibrate-budget-s",
    type=_POSITIVE,
    default=20.0,
    show_default=True,
    help="Rough bound on the layer timing's duration.",
)
@click.option(
    "--calibrate-threads",
    type=click.IntRange(min=1, max=1024),
    help="CPU threads the layer timing may use (torch.set_num_threads) [default: torch's, "
    "every core]. Give the threads one server gets (1 for a server pinned to one core), or "
    "the layer's FLOP/s overstate what that server computes.",
)
@click.option(
    "--nixl-sizes-mib",
    default="1,8,32",
    show_default=True,
    help="Comma-separated transfer sizes for the NIXL bandwidth probe.",
)
@click.option(
    "--calibration",
    "calibration_path",
    type=click.Path(dir_okay=False, exists=True),
    help="Plan with figures measured earlier: a benchmarks/gpu_proof.py calibration file, or "
    "the JSON of 'plan --calibrate --json'.",
)
@click.option(
    "--handoff-results",
    type=click.Path(dir_okay=False, exists=True),
    help="JSON from benchmarks/handoff.py to check the calibrated handoff against.",
)
def plan(
    model_name: str,
    kv_dtype: str,
    weight_dtype: str,
    gpu: str,
    gpus_per_replica: int | None,
    efficiency: float,
    link_name: str,
    link_gbps: float | None,
    prompt_tokens: int,
    output_tokens: int,
    rate: float | None,
    ttft_ms: float | None,
    itl_ms: float | None,
    as_json: bool,
    calibrate: bool,
    calibrate_device: str,
    calibrate_tokens: str,
    calibrate_budget_s: float,
    nixl_sizes_mib: str,
    handoff_results: str | None,
    calibration_path: str | None,
    calibrate_threads: int | None = None,
    prefill_gpu: str | None = None,
    decode_gpu: str | None = None,
    prefill_gpus_per_replica: int | None = None,
    decode_gpus_per_replica: int | None = None,
    price_items: tuple[str, ...] = (),
) -> None:
    """KV size, handoff per link, prefill intensity, chunk and pool advice, and a verdict."""
    try:
        model = get_model(model_name)
        link = custom_link(link_gbps) if link_gbps is not None else get_link(link_name)
        acc = get_accelerator(gpu)
        workload = Workload(
            prompt_tokens=prompt_tokens, output_tokens=output_tokens, request_rate=rate
        )
        slo_fields = _slo_fields(ttft_ms, itl_ms)
        slo = Slo(**slo_fields)
        weight_bytes = WEIGHT_DTYPE_BYTES[weight_dtype.lower()]
        measured: CalibrationResult | None = None
        loaded: LoadedCalibration | None = None
        if calibrate and calibration_path:
            raise PlannerInputError(
                "--calibrate and --calibration: choose one (measure now, or use a file)"
            )
        if calibration_path:
            loaded = _load_calibration(Path(calibration_path), gpu)
            acc, weight_bytes = loaded.accelerator, loaded.weight_bytes
            if loaded.link is not None and not _link_given(link_gbps):
                link = loaded.link
        if calibrate:
            measured = _calibrate(
                model,
                kv_dtype=kv_dtype,
                device=calibrate_device,
                tokens=calibrate_tokens,
                budget_s=calibrate_budget_s,
                nixl_sizes_mib=nixl_sizes_mib,
                handoff_results=handoff_results,
                threads=calibrate_threads,
            )
            acc, weight_bytes = measured.accelerator, measured.weight_bytes
            if not _link_given(link_gbps):
                link = measured.link
            gpus_per_replica, efficiency = 1, 1.0
        elif handoff_results:
            raise PlannerInputError(
                "--handoff-results needs --calibrate (it checks measured "
                "figures against the benchmark)"
            )
        phases = _phases(
            model,
            acc,
            weight_bytes,
            gpus_per_replica,
            (prefill_gpu, decode_gpu),
            (prefill_gpus_per_replica, decode_gpus_per_replica),
            price_items,
        )
        result_plan = make_plan(
            model,
            acc,
            link,
            kv_dtype=kv_dtype,
            workload=workload,
            slo=slo,
            gpus_per_replica=gpus_per_replica,
            efficiency=efficiency,
            weight_bytes=weight_bytes,
            slo_given=bool(slo_fields),
            phases=phases,
        )
    except PlannerInputError as e:
        raise click.ClickException(str(e)) from None
    except ValidationError as e:
        raise click.ClickException(explain_validation(e)) from None
    if measured is not None:
        _attach_calibration(result_plan, measured, link)
    if loaded is not None:
        result_plan.calibration = loaded.section()
        result_plan.assumptions.insert(
            0,
            f"calibrated from {loaded.path}: accelerator figures measured on "
            f"{loaded.measured_on} (achieved, not peak; --efficiency applies on top)"
            + f"; KV link {link.name}"
            + (" (measured with it)" if link is loaded.link else " (not from the file)"),
        )
    click.echo(render_json(result_plan) if as_json else render_text(result_plan))


def _phases(
    model: ModelShape,
    acc: Accelerator,
    weight_bytes: int,
    gpus_per_replica: int | None,
    gpus: tuple[str | None, str | None],
    counts: tuple[int | None, int | None],
    price_items: tuple[str, ...],
) -> PhaseHardware | None:
    """Hardware per pool when any per-pool option is given (catalog accelerators; the
    colocated pool keeps --gpu), else None (one hardware type, the plan as before)."""
    if not any(gpus) and not any(counts) and not price_items:
        return None
    pre = get_accelerator(gpus[0]) if gpus[0] else acc
    dec = get_accelerator(gpus[1]) if gpus[1] else acc

    def per_replica(a: Accelerator, given: int | None) -> int:
        return given or gpus_per_replica or auto_gpus_per_replica(model, a, weight_bytes)

    return PhaseHardware(
        prefill=pre,
        decode=dec,
        prefill_gpus=per_replica(pre, counts[0]),
        decode_gpus=per_replica(dec, counts[1]),
        colocated_gpus=per_replica(acc, None),
        prices=parse_prices(price_items),
    )


def parse_prices(items: tuple[str, ...]) -> dict[str, float]:
    """``GPU=DOLLARS`` options as a dict; a malformed one is a ``PlannerInputError``."""
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not name or not price >= 0:
            raise PlannerInputError(f"--price {item!r}: expected GPU=DOLLARS_PER_GPU_HOUR")
        out[name] = price
    return out


def _slo_fields(ttft_ms: float | None, itl_ms: float | None) -> dict[str, float]:
    """The SLO targets given on the command line, in seconds (the rest keep their defaults)."""
    fields: dict[str, float] = {}
    if ttft_ms is not None:
        fields["ttft_s"] = ttft_ms / 1e3
    if itl_ms is not None:
        fields["itl_s"] = itl_ms / 1e3
    return fields


def _link_given(link_gbps: float | None) -> bool:
    """Whether the user chose the KV link (``--link`` or ``--link-gbps``), which a calibrated
    plan then keeps instead of the measured one."""
    return (
        link_gbps is not None
        or click.get_current_context().get_parameter_source("link_name")
        == click.core.ParameterSource.COMMANDLINE
    )


def _calibrate(
    model: ModelShape,
    *,
    kv_dtype: str,
    device: str,
    tokens: str,
    budget_s: float,
    nixl_sizes_mib: str,
    handoff_results: str | None,
    threads: int | None = None,
) -> CalibrationResult:
    """Measure this machine (imports torch and NIXL only now); a failure is one ``Error:``."""
    from splitserve.planner.calibrate import CalibrationError, calibrate_machine

    try:
        return calibrate_machine(
            model,
            kv_dtype=kv_dtype,
            device=device,
            tokens=_int_list("--calibrate-tokens", tokens),
            budget_s=budget_s,
            nixl_sizes=[n << 20 for n in _int_list("--nixl-sizes-mib", nixl_sizes_mib)],
            handoff_results=Path(handoff_results) if handoff_results else None,
            threads=threads,
        )
    except CalibrationError as e:
        raise click.ClickException(str(e)) from None


def _load_calibration(path: Path, gpu: str) -> LoadedCalibration:
    """A calibration file, checked against ``--gpu`` when the command line names one."""
    loaded = load_calibration(path)
    given = (
        click.get_current_context().get_parameter_source("gpu")
        == click.core.ParameterSource.COMMANDLINE
    )
    if given and not loaded.matches(gpu):
        raise PlannerInputError(
            f"--calibration {path} was measured on {loaded.measured_on}, not --gpu {gpu}"
        )
    return loaded


def _attach_calibration(result_plan: Plan, measured: CalibrationResult, link: Link) -> None:
    """The measurements beside the plan, and first among its assumptions what they replaced."""
    result_plan.calibration = measured.to_dict()
    used = "hardware and link figures" if link is measured.link else "hardware figures"
    result_plan.assumptions.insert(
        0,
        f"calibrated: {used} measured on this machine (see Calibration); --gpu, "
        "--gpus-per-replica and --efficiency are not used"
        + ("" if link is measured.link else f"; KV link {link.name} as given"),
    )


def _int_list(option: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PlannerInputError(
            f"{option}: expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise PlannerInputError(f"{option}: expected positive integers, got {text!r}")
    return values
