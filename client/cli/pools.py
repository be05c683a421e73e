"""Concurrency pools: ``pool set|ls|rm``.

A pool limits how many claims (or consumes) of the entries that name it are held at
once, across agents and tasks: the protected resource's capacity (a supplier's quota,
a model service, a database's connections). Its limit can be changed while work runs:
lowering it takes nothing away, new claims wait until fewer are held.
"""

from __future__ import annotations

import click

from ._common import (
    BatonGroup,
    Settings,
    as_dict,
    emit_json,
    emit_table,
    folding_table,
    output_option,
    pass_settings,
)
from ._root import cli


@cli.group(cls=BatonGroup)
def pool() -> None:
    """Concurrency pools: define them, change their limits, see who holds them."""


@pool.command("set")
@click.argument("name")
@click.option("--limit", required=True, type=click.IntRange(1, 10_000),
              help="units: claims of its entries held at once")
@click.option("--reason", default="", help="why (logged by the registry)")
@click.option("--evidence", default="", help="a link or text backing --reason")
@output_option
@pass_settings
def pool_set(settings: Settings, name: str, limit: int, reason: str, evidence: str,
             output: str) -> None:
    """Define pool NAME with --limit units, or change its limit.

    An entry names the pool its producer's claim (or a consumer group's lease)
    needs in its manifest (`pools`); a claim takes a unit, and gives it back when
    it ends, whichever way it ends. At the limit, its entries are passed over
    (others are claimed) until a unit comes back. Lowering the limit takes no
    unit away.
    """
    info = settings.client().operator.set_pool(name, limit, reason=reason, evidence=evidence)
    if output == "json":
        emit_json(as_dict(info))
        return
    click.echo(f"pool {info.name}: limit {info.limit}, {info.in_use} in use, "
               f"{info.waiting} waiting")


@pool.command("ls")
@output_option
@pass_settings
def pool_ls(settings: Settings, output: str) -> None:
    """List the pools: limit, units in use, entries waiting, holders.

    Waiting: claimable entries (ready to produce, or verified for a group) of the
    tasks that name the pool, which need one of its units. Holders: the claims
    holding its units (task/file, group, agent). A pool with units held but no
    definition (removed meanwhile) shows limit 0. -o json: a list of PoolInfo.
    """
    pools = settings.client().operator.list_pools()
    if output == "json":
        emit_json([as_dict(p) for p in pools])
        return
    if not pools:
        click.echo("no pools: `baton pool set NAME --limit N` defines one")
        return
    table = folding_table("pool", "limit", "in_use", "waiting", "holders",
                          whole=("pool", "limit", "in_use", "waiting"))
    for p in pools:
        held = ", ".join(f"{h.task_id}/{h.file_id}" + (f" ({h.group})" if h.group else "")
                         + f" by {h.agent}" for h in p.holders) or "-"
        table.add_row(p.name, str(p.limit) if p.limit else "- (not defined)",
                      str(p.in_use), str(p.waiting), held)
    emit_table(table)


@pool.command("rm")
@click.argument("name")
@click.option("--reason", default="", help="why (logged by the registry)")
@click.option("--evidence", default="", help="a link or text backing --reason")
@pass_settings
def pool_rm(settings: Settings, name: str, reason: str, evidence: str) -> None:
    """Remove pool NAME's definition.

    Its entries wait (they are not claimed) until it is defined again; units held
    come back with their claims. Exit 5 if there is no such pool.
    """
    from ...kernel import errors

    if not settings.client().operator.delete_pool(name, reason=reason, evidence=evidence):
        raise errors.NotFound(f"no pool {name!r}", pool=name)
    click.echo(f"pool {name} removed")
