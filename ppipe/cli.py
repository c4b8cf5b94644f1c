"""The ``ppipe`` command: a thin click group over the Python API.

Each sub-package owns its commands (``ppipe/<subpackage>/cli.py``); this module only
registers them lazily, so ``ppipe plan`` never imports Ray or onnxruntime. A
:class:`~ppipe.errors.UserError` anywhere below ends the command with its message and
exit code 2, without a traceback.
"""

from __future__ import annotations

import importlib
import sys

import click

from ppipe import __version__
from ppipe.errors import UserError

# command name -> "module:attribute"
COMMANDS: dict[str, str] = {
    "profile": "ppipe.profiler.cli:profile",
    "import-ppipe": "ppipe.spec.cli:import_ppipe",
    "schema": "ppipe.spec.cli:schema",
    "plan": "ppipe.planner.cli:plan",
    "simulate": "ppipe.sim.cli:simulate",
    "serve": "ppipe.runtime.cli:serve",
    "bench": "ppipe.runtime.cli:bench",
    "apply": "ppipe.runtime.cli:apply",
}


class LazyGroup(click.Group):
    """A group whose commands are imported only when used, and that renders UserErrors."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("ppipe"):
                return _unavailable(name, f"'{module_name}' is not part of this ppipe build yet")
            raise
        return getattr(module, attr)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"error: {exc.render()}", err=True)
            sys.exit(exc.exit_code)


def _unavailable(name: str, why: str) -> click.Command:
    @click.command(name=name, context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def _cmd(args):  # pragma: no cover - only until every subsystem lands
        raise UserError(f"`ppipe {name}` is not available: {why}")

    return _cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ppipe")
def main() -> None:
    """ppipe: pool-based pipeline-parallel CNN serving on heterogeneous GPU clusters.

    \b
    profile       ONNX model -> blocks and their latency per GPU type x vGPU x batch
    import-ppipe  PPipe artifact profiles -> ppipe model profiles
    plan          cluster + model profiles -> plan.yaml (MILP)
    simulate      plan.yaml under a virtual clock: SLO attainment, load sweeps
    serve         plan.yaml on Ray behind an Open Inference Protocol (KServe v2) API
    bench         open-loop load generator against a running `ppipe serve`
    apply         switch a running `ppipe serve` to a new plan.yaml, live
    schema        the fields of a cluster YAML, a model profile or plan.yaml
    """


if __name__ == "__main__":  # pragma: no cover
    main()
