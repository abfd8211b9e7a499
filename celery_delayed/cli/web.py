"""``celery -A proj delayed web``: serve the dashboard."""

from __future__ import annotations

import signal
import threading
from types import FrameType

import click

from ..web import MIN_TOKEN_LENGTH, Auth, make_server
from ._common import app_of, delayed


@delayed.command()
@click.option("--port", default=5566, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Address to bind (another than loopback needs --basic-auth or a --token of at least "
                   f"{MIN_TOKEN_LENGTH} characters).")
@click.option("--basic-auth", "basic_auth", default=None, metavar="USER:PASSWORD",
              help="Require HTTP basic authentication (as Flower's --basic-auth).")
@click.option("--token", default=None, envvar="CELERY_DELAYED_WEB_TOKEN",
              help="Require this token: 'Authorization: Bearer <token>', or open /login?token=<token> once.")
@click.option("--read-only", "read_only", is_flag=True, help="Serve no action (cancel, requeue, pause ...).")
@click.pass_context
def web(ctx: click.Context, port: int, address: str, basic_auth: str | None, token: str | None,
        read_only: bool) -> None:
    """Serve the web dashboard until SIGTERM or SIGINT."""
    if basic_auth is not None and token is not None:
        raise click.UsageError("give --basic-auth or --token, not both")
    if token is not None and not token.strip():
        # `--token "$TOKEN"` with the variable unset: refused, as an empty --basic-auth password is
        raise click.UsageError("--token is empty (an unset variable?): give a token of at least "
                               f"{MIN_TOKEN_LENGTH} characters, or leave --token out")
    try:
        auth = Auth.basic(basic_auth) if basic_auth is not None else Auth(token=token)
        server = make_server(app_of(ctx), address, port, auth, read_only)
    except (ValueError, PermissionError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    host, bound = str(server.server_address[0]), int(server.server_address[1])
    click.echo(f"celery-delayed dashboard on http://{host}:{bound}/"
               + (" (read-only)" if read_only else "") + (" (basic auth)" if basic_auth else "")
               + (" (token)" if token else ""), err=True)
    stop = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    thread = threading.Thread(target=server.serve_forever, name="celery-delayed-web", daemon=True)
    thread.start()
    while not stop.wait(0.5):
        pass
    server.shutdown()
    server.server_close()
