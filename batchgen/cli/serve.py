"""`batchgen serve`: the Batch API (batchgen/serve/) and the process around it (uvicorn, signals)."""

from __future__ import annotations

from pathlib import Path

import click

from ..core.errors import BatchgenError, ConfigError
from .flags import fail
from .options import option
from .process import say

__all__ = ["serve"]


@click.command()
@option("--model", help="The model every batch runs with (a path or hub id) [the preset's].")
@option("-c", "--config", "preset", help="A preset name or YAML file: the runs' settings.")
@option(
    "--data",
    type=click.Path(path_type=Path),
    default=Path("batchgen-serve"),
    show_default=True,
    help="Folder of the server's state: its SQLite store, files and batch runs.",
)
@option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", envvar="BATCHGEN_API_KEY", help="The key clients send as a bearer token.")
@option("--no-auth", is_flag=True, help="Serve without a key (only on a loopback --host).")
@option("--allow-private-urls", is_flag=True, help="Clients' media URLs may reach private hosts.")
@option("--batch-size", type=int, help="Rows decoded together [the preset's].")
@option("--max-file-bytes", type=int, default=200 * 2**20, show_default=True, help="Largest upload.")
@option("--max-lines", type=int, default=50_000, show_default=True, help="Most requests in a batch file.")
@option("--max-line-bytes", type=int, default=64 * 2**20, show_default=True, help="Largest request line.")
def serve(
    model: str | None,
    preset: str | None,
    data: Path,
    host: str,
    port: int,
    api_key: str | None,
    no_auth: bool,
    allow_private_urls: bool,
    batch_size: int | None,
    max_file_bytes: int,
    max_lines: int,
    max_line_bytes: int,
) -> None:
    """Serve the OpenAI Files and Batches API (the official clients drive it unchanged: give
    them base_url http://HOST:PORT/v1 and the key), with a status page at http://HOST:PORT/.

    Batches run one after another in creation order, each as `batchgen run` runs a job, on
    one model. Killed and started again on the same --data, every batch goes on where it was."""
    import uvicorn

    from ..serve.queue import ServeSettings
    from ..serve.service import Service, is_loopback

    try:
        if no_auth and not is_loopback(host):
            raise ConfigError(f"--no-auth serves anyone who can reach {host}: only on a loopback --host")
        if api_key is None and not no_auth:
            raise ConfigError("an API key is needed: --api-key or BATCHGEN_API_KEY (--no-auth on loopback)")
        if (
            api_key is not None
            and not no_auth
            and (len(api_key) < 8 or not api_key.isprintable() or " " in api_key)
        ):
            raise ConfigError(
                "--api-key: at least 8 printable characters, no spaces (clients send it as a token)"
            )
        overrides = {"batch_size": batch_size} if batch_size else {}
        settings = ServeSettings(
            model=model,
            preset=preset,
            overrides=overrides,
            max_file_bytes=max_file_bytes,
            max_lines=max_lines,
            max_line_bytes=max_line_bytes,
            allow_private_urls=allow_private_urls,
        )
        service = Service.open(data, settings, None if no_auth else api_key)
    except BatchgenError as e:
        fail(e)
    say(f"serving {data} on http://{host}:{port}/ (batches run one at a time, oldest first)")
    service.queue.start()
    try:
        uvicorn.Server(uvicorn.Config(service.app, host=host, port=port, log_level="warning")).run()
    finally:
        service.close()
    say("stopped; the batches go on when the server starts again")
