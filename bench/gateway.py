"""A real gateway in front of the partner: Debian's ``nginx-light`` with ``limit_req``.

Partners behind an API gateway are limited by the gateway, not by their own code: nginx's
``limit_req`` at ``rate=Rr/s`` with no burst refuses any request that comes less than 1/R
after the last one it let through, on its own millisecond clock, and says nothing about
when to come back. A gateway cell runs the simulator unlimited behind one nginx process
(``proxy_pass``, keep-alive upstream) and the service, the peers and the oracle talk to
nginx. Its refusals never reach the simulator, so they are counted from nginx's access
log and added to the partner's ``requests`` and ``rate_limited``
(:meth:`Gateway.refused`).

Two variants, since gateways differ in what their 429 says: ``nginx`` answers a bare 429
(``limit_req_status 429``; nginx's default is 503), ``nginx-retry-after`` adds a static
``Retry-After: 1`` (what a team adds with ``error_page`` so clients back off), which a
client must honour although the bucket is free again after 1/R.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from processes import free_port, stop_process

GATEWAYS = ("nginx", "nginx-retry-after")
NGINX = "/usr/sbin/nginx"

_CONF = """\
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 512; }}
http {{
    log_format gateway '$msec $status';
    access_log {dir}/access.log gateway;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    limit_req_zone $binary_remote_addr zone=partner:1m rate={rate}r/s;
    limit_req_status 429;
    upstream partner {{
        server 127.0.0.1:{upstream_port};
        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            limit_req zone=partner;
            proxy_pass http://partner;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
{limited}    }}
}}
"""

_RETRY_AFTER = """\
        error_page 429 = @limited;
        location @limited {
            add_header Retry-After 1 always;
            return 429 '{"error": "rate limited"}';
        }
"""


class Gateway:
    """A running nginx: the URL clients use and its refusals so far."""

    def __init__(self, url: str, access_log: Path) -> None:
        self.url, self.access_log = url, access_log

    def refused(self) -> int:
        """The 429s nginx has answered (its access log is written unbuffered)."""
        try:
            text = self.access_log.read_text()
        except FileNotFoundError:
            return 0
        return sum(1 for line in text.splitlines() if line.endswith(" 429"))


def available() -> str | None:
    """Why a gateway cell cannot run here (None: it can)."""
    if shutil.which(NGINX) is None and shutil.which("nginx") is None:
        return "nginx is not installed (apt-get install nginx-light)"
    return None


def config(kind: str, rate: float, port: int, upstream_port: int, directory: Path) -> str:
    if kind not in GATEWAYS:
        raise ValueError(f"unknown gateway {kind!r}; known: {', '.join(GATEWAYS)}")
    # nginx takes a whole number of requests per second (or per minute): r/s it is.
    if rate != int(rate) or rate < 1:
        raise ValueError(f"nginx limit_req takes whole requests per second, not {rate:g}")
    return _CONF.format(dir=directory, rate=int(rate), port=port, upstream_port=upstream_port,
                        limited=_RETRY_AFTER if kind == "nginx-retry-after" else "")


@contextlib.asynccontextmanager
async def nginx(kind: str, rate: float, upstream_port: int, log: Path) -> AsyncIterator[Gateway]:
    """One nginx in front of ``127.0.0.1:upstream_port``; its stderr goes to ``log``."""
    why = available()
    if why:
        raise RuntimeError(why)
    with tempfile.TemporaryDirectory(prefix="bench-nginx-") as tmp:
        directory, port = Path(tmp), free_port()
        binary, conf = _lay_out(kind, rate, port, upstream_port, directory)
        with log.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                binary, "-p", str(directory), "-c", str(conf), "-e", str(directory / "error.log"),
                stdout=asyncio.subprocess.DEVNULL, stderr=err)
        try:
            await _listening(port, proc, directory)
            yield Gateway(f"http://127.0.0.1:{port}", directory / "access.log")
        finally:
            await stop_process(proc, grace_s=5)
            error_log = directory / "error.log"
            if error_log.exists():
                with log.open("ab") as out:
                    out.write(error_log.read_bytes())


def _lay_out(kind: str, rate: float, port: int, upstream_port: int,
             directory: Path) -> tuple[str, Path]:
    """nginx's binary and its configuration, written into ``directory``."""
    binary = NGINX if Path(NGINX).exists() else str(shutil.which("nginx"))
    directory.chmod(0o755)  # run as root, nginx's worker is another user
    conf = directory / "nginx.conf"
    conf.write_text(config(kind, rate, port, upstream_port, directory))
    return binary, conf


async def _listening(port: int, proc: asyncio.subprocess.Process, directory: Path) -> None:
    for _ in range(200):
        if proc.returncode is not None:
            tail = (directory / "error.log").read_text(errors="replace")[-400:] \
                if (directory / "error.log").exists() else ""
            raise RuntimeError(f"nginx exited {proc.returncode} before it listened: {tail}")
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            await writer.wait_closed()
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"nginx did not listen on {port} within 10 s")
