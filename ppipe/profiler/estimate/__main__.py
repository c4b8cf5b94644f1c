"""Refit the estimators' shipped parameters from a PPipe artifact folder.

    python -m ppipe.profiler.estimate fit-cross-gpu ../shared/data/ppipe-artifact
    python -m ppipe.profiler.estimate fit-roofline ../shared/data/ppipe-artifact
    python -m ppipe.profiler.estimate fit-measured H100 docs/measurements/h100-2026-11-27/*/
"""

from __future__ import annotations

import os
import sys

# Hundreds of small solves: one BLAS thread is faster than a contended pool (set before
# numpy loads).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import click  # noqa: E402

from ppipe.errors import UserError  # noqa: E402
from ppipe.profiler.estimate.crossgpu import DATA_FILE, fit_cross_gpu  # noqa: E402
from ppipe.profiler.estimate.roofline import PARAMS_FILE, fit_measured, fit_roofline  # noqa: E402

_ARTIFACT = click.argument("artifact", type=click.Path(file_okay=False))


@click.group(
    name="python -m ppipe.profiler.estimate",
    help=__doc__.split("\n\n")[0],
    context_settings={"help_option_names": ["-h", "--help"]},
)
def cli() -> None:
    pass


@cli.command("fit-cross-gpu")
@_ARTIFACT
@click.option("--out", default=str(DATA_FILE), show_default=True, help="Where to write the parameters (.npz).")
def fit_cross_gpu_cmd(artifact: str, out: str) -> None:
    """Fit the cross-GPU model (writes cross_gpu.npz)."""
    m = fit_cross_gpu(artifact, out=out)
    click.echo(f"fitted {len(m.regressors)} regressors on {len(m.models)} models -> {out}")


@cli.command("fit-roofline")
@_ARTIFACT
@click.option("--out", default=str(PARAMS_FILE), show_default=True, help="Where to write the constants (.json).")
def fit_roofline_cmd(artifact: str, out: str) -> None:
    """Fit the roofline constants (writes roofline_params.json)."""
    doc = fit_roofline(artifact, out=out)
    for g, p in doc["gpus"].items():
        click.echo(f"{g} {({k: round(v, 4) for k, v in p.items()})}")
    click.echo(f"-> {out}")


@cli.command("fit-measured")
@click.argument("gpu")
@click.argument("profiles", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option("--out", default=str(PARAMS_FILE), show_default=True, help="Where to write the constants (.json).")
def fit_measured_cmd(gpu: str, profiles: tuple[str, ...], out: str) -> None:
    """Fit one GPU type's roofline constants on its measured rows in ppipe profiles (writes roofline_params.json)."""
    p = fit_measured(gpu, list(profiles), out=out)["gpus"][gpu]
    click.echo(f"{gpu} {({k: round(v, 4) for k, v in p.items() if isinstance(v, float)})}")
    click.echo(f"fitted on {p['measured_on']['summary']}")
    click.echo(f"-> {out}; GPU types whose calibration in gpus.yaml is {gpu} use it")


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit code
    (2 for a :class:`~ppipe.errors.UserError` or a usage error, printed on stderr)."""
    try:
        cli.main(args=argv, standalone_mode=False)
    except UserError as exc:
        click.echo(exc.render(), err=True)
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
