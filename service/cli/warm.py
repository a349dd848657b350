"""``jitserve warm MANIFEST``: compile a manifest into the shared tiers, then exit.

It runs the server's own parts (``service.app.serving``: runtimes decode and
compile, this process never does) without an HTTP front, until the manifest's
compiles are done, and prints a line per executable::

    jitserve warm warm.toml --cache-dir /var/cache/jitserve
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..calls.warming import Warming
    from ..settings import Settings

__all__ = ["run"]


def run(settings: Settings, manifest: Path) -> int:
    """Compile ``manifest`` into the shared tiers and print a table; the exit status."""
    from ..calls.warming import ManifestError, load_manifest

    if not settings.disk_cache and settings.redis_settings() is None:
        print("jitserve warm: nothing to warm into: the disk tier is off and no Redis is set "
              "(use --cache-dir, or --redis-url)", file=sys.stderr)
        return 2
    try:
        items = load_manifest(manifest)
    except ManifestError as e:
        print(f"jitserve warm: {e}", file=sys.stderr)
        return 2
    from .. import logs

    logs.configure(settings.log_level, settings.log_format)
    warming = asyncio.run(_warm(settings.model_copy(update={"warm": manifest}), len(items)))
    for r in warming.results:
        outcome = r.error or f"{r.tier:<9} {r.executable_id}"
        print(f"{'FAILED' if r.error else 'ok':<6}  {r.item}  {outcome}")
    tiers = ", ".join(filter(None, [f"disk {settings.cache_dir}" if settings.disk_cache else "",
                                    "redis" if settings.redis_url else ""]))
    print(f"warmed {len(warming.results) - len(warming.failed)} of {len(items)} executables "
          f"into {tiers} in {warming.seconds or 0:.1f} s")
    return 1 if warming.failed else 0


async def _warm(settings: Settings, total: int) -> Warming:
    """The server's parts on runtimes of their own, until the warming is done."""
    from tqdm import tqdm

    from ..app import serving, start_pool
    from ..calls.warming import WarmResult
    from ..metrics import Metrics

    with tqdm(total=total, unit="exe", desc="warming", disable=not sys.stderr.isatty(),
              file=sys.stderr) as bar:

        def progress(result: WarmResult) -> None:
            bar.set_postfix_str(f"{result.item.file.name}: {result.tier or 'failed'}")
            bar.update(1)

        pool = await start_pool(settings, own_loop=True)
        try:
            async with serving(settings, Metrics(), pool, on_warm=progress) as services:
                assert services.warming is not None  # settings.warm names the manifest
                await services.warming.wait()
                return services.warming
        finally:
            await asyncio.to_thread(pool.close)
