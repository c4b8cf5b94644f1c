"""``ppipe import-ppipe``: PPipe artifact profiles -> ppipe model profiles."""

from __future__ import annotations

import click

from ppipe.spec.artifact import artifact_models, import_artifact


@click.command("import-ppipe")
@click.argument("artifact_dir", type=click.Path(file_okay=False))
@click.option("--model", "models", multiple=True, help="Model to import (repeatable); default: every model in the folder.")
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder to write <model>/ profiles into.")
def import_ppipe(artifact_dir: str, models: tuple[str, ...], out_dir: str) -> None:
    """Import the PPipe artifact's block timings (ARTIFACT_DIR) as ppipe model profiles."""
    names = list(models) or artifact_models(artifact_dir)
    folders = import_artifact(artifact_dir, out_dir, names)
    for f in folders:
        click.echo(f"wrote {f}/model.yaml and profile.csv")
    click.echo(f"{len(folders)} model(s) imported into {out_dir}")


@click.command("schema")
@click.argument("kind", type=click.Choice(["cluster", "model", "plan"]))
def schema(kind: str) -> None:
    """Print the fields of a file format: a cluster YAML, a model profile, or plan.yaml."""
    from ppipe.spec.schema import render

    click.echo(render(kind))
