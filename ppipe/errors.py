"""Errors that reach the user.

Every mistake a user can make (a malformed YAML file, a profile that does not match the
cluster, an SLO nobody can meet) is raised as a :class:`UserError`. The CLI prints its
message on one block and exits with code 2; it never shows a traceback for these.
A message names the file, the field and the fix.
"""

from __future__ import annotations


class PpipeError(Exception):
    """Base class of every error ppipe raises on purpose."""


class UserError(PpipeError):
    """A mistake in the user's input. The CLI prints it and exits with code 2.

    Args:
        message: what is wrong, naming the file and field where there is one.
        fix: how to fix it; printed on a line of its own after ``To fix:``.
        file: the file the mistake is in, if any.
    """

    exit_code = 2

    def __init__(self, message: str, *, fix: str | None = None, file: str | None = None):
        self.message = message
        self.fix = fix
        self.file = file
        super().__init__(self.render())

    def render(self) -> str:
        head = f"{self.file}: {self.message}" if self.file else self.message
        return f"{head}\n  To fix: {self.fix}" if self.fix else head


class SpecError(UserError):
    """A file (cluster, model profile, plan) that does not follow its schema."""


class InfeasibleError(UserError):
    """No plan satisfies the constraints (e.g. no GPU type meets the SLO)."""


class SolverError(PpipeError):
    """The solver failed without a usable solution (not a user mistake)."""


class NotAvailableError(UserError):
    """An optional component (TensorRT, CUDA, Gurobi, ...) is not installed or usable."""
