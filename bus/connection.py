"""A connection to the broker: NATS core + JetStream, with reconnect, quiet errors and auth.

`await connect(cfg, url, name=)` returns a `Bus`: a broker that does not answer yet is waited
for up to `cfg.connect_give_up_s`, said at the first refusal and every 15 s (`BusError` after;
refused credentials fail at once), then a
lost broker is reconnected to forever; client errors are one line each; auth (user/password,
token, creds file, NKey seed file, TLS, mutual TLS) comes from the config (`ConfigError` for
unusable settings); `url` may list several servers, comma-separated (a cluster: the client
fails over; `Bus.server` says which one now); a permission the broker refuses is
`bus.denied.PermissionDenied`, not a wait. docs/bus.md, "Connection"; docs/cluster.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.errors import AuthorizationError, NoServersError
from nats.js import JetStreamContext
from specbus.bus.denied import Denials
from specbus.bus.outage import Outage, ride
from specbus.core.config import BusConfig
from specbus.core.errors import BusError, ConfigError

log = logging.getLogger("specbus.bus")


class Bus:
    """One broker connection: `nc` (core NATS), `js` (JetStream), the bus config it used, and
    its `outage` state (`bus.outage`)."""

    def __init__(self, nc: NATS, cfg: BusConfig, url: str, quiet: _QuietErrors | None = None):
        self.nc = nc
        self._quiet = quiet
        self.js: JetStreamContext = nc.jetstream(timeout=cfg.connect_timeout_s)
        self.cfg = cfg
        self.url = url
        self.outage = Outage(url, cfg.outage_give_up_s)
        self.closing = False  # close() was called: a closed connection is no outage
        if quiet is not None:
            quiet.bus = self

    @property
    def connected(self) -> bool:
        """True while the connection to the broker is up."""
        return self.nc.is_connected

    @property
    def server(self) -> str | None:
        """The server this connection talks to now (one of a cluster's URLs)."""
        url = self.nc.connected_url
        return f"{url.scheme}://{url.hostname}:{url.port}" if url else None

    def raise_if_denied(self) -> None:
        """Raise `PermissionDenied` for a refusal of the broker not reported yet."""
        if self._quiet is not None and self._quiet.denials:
            raise self._quiet.denials.take()

    @property
    def reconnects(self) -> int:
        """How many times this connection was re-established (requests in flight were lost)."""
        return self._quiet.reconnects if self._quiet is not None else 0

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until everything written (acks included) reached the server; rides through
        an outage (what the client buffered meanwhile is sent on reconnect, then flushed)."""
        await ride(self, "flushing to the broker", lambda: self.nc.flush(timeout=timeout_s))

    async def close(self) -> None:
        """Flush what is buffered and close; idempotent. During an outage, what the client
        buffered is dropped (no broker to flush to)."""
        self.closing = True
        if self.nc.is_closed:
            return
        try:
            await self.nc.drain()
        except Exception:  # a dead broker at shutdown: nothing left to flush to
            try:
                await self.nc.close()
            except (OSError, nats.errors.Error) as e:  # its socket is gone already: closed
                log.info("connection closed during an outage (%s)", e)

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class _QuietErrors:
    """Error/disconnect callbacks: one line per distinct error, and the outage's clock.

    While the broker is away (disconnected, reconnecting) the connection's lines are INFO
    (the first of each error) or DEBUG (repeats): `bus.outage` says WARNING once per outage,
    naming the operation that noticed it."""

    def __init__(self, name: str):
        self.name = name
        self.last = ""
        self.reconnects = 0
        self.auth_failed = False  # the server refused the credentials
        self.denials = Denials(f"connection {name!r}")
        self.tls_error: ssl.SSLError | None = None  # the first connection's handshake failed
        self.refused: OSError | None = None  # the first connection's first refusal
        self.bus: Bus | None = None

    def _away(self, e: Exception) -> bool:
        """Once connected: the broker is away (or the error says it just went: EOF, a
        refused reconnect). The first connection's errors stay WARNING: no outage yet."""
        bus = self.bus
        if bus is None:
            return False
        if isinstance(e, (nats.errors.StaleConnectionError, OSError)):
            return True
        return bus.closing or bus.outage.active or not bus.connected

    async def error(self, e: Exception) -> None:
        # nats-py reports a refused login as a plain Error('Authorization Violation')
        refused = isinstance(e, AuthorizationError) or "authoriz" in str(e).lower()
        self.auth_failed = self.auth_failed or refused
        if isinstance(e, ssl.SSLError) and self.bus is None:
            self.tls_error = e
        elif isinstance(e, OSError) and self.bus is None and self.refused is None:
            self.refused = e  # said at once by the first connection (`_first_connection`)
        line = f"{type(e).__name__}: {e}".strip()
        if self.denials.add(str(e)):
            log.error("nats[%s] %s", self.name, line)
            return
        if line == self.last:
            level = logging.DEBUG
        else:
            level = logging.INFO if self._away(e) else logging.WARNING
        self.last = line
        log.log(level, "nats[%s] %s", self.name, line)

    async def disconnected(self) -> None:
        bus = self.bus
        if bus is None or bus.closing:
            return
        bus.outage.lost()
        log.info("nats[%s] disconnected; reconnecting", self.name)

    async def reconnected(self) -> None:
        self.reconnects += 1
        self.last = ""
        if self.bus is not None:
            self.bus.outage.reconnected()
        log.info("nats[%s] reconnected", self.name)


async def _connect_once(options: dict, quiet: _QuietErrors, tick=None) -> NATS:
    """`nats.connect`, but a failed TLS handshake (a certificate the other side refuses) is
    a `BusError` at once: nats-py reports it to the error callback and then waits forever.
    `tick()` is called every 50 ms meanwhile (nats-py retries a refused server inside)."""
    task = asyncio.ensure_future(nats.connect(**options))
    while not task.done():
        await asyncio.wait({task}, timeout=0.05)
        if not task.done() and quiet.tls_error is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            e = quiet.tls_error
            raise BusError(f"TLS handshake with the broker failed: {type(e).__name__}: {e}") from e
        if tick is not None:
            tick()
    return task.result()


PROGRESS_S = 15.0  # a line this often while a first connection waits for the broker


async def _first_connection(url: str, options: dict, quiet: _QuietErrors, give_up_s: float) -> NATS:
    """Connect, retrying a broker that does not answer yet for up to `give_up_s`: one WARNING
    line as soon as a server refuses (what was tried, how to start a broker, until when), one
    every `PROGRESS_S` while it waits, one when connected. Refused credentials and bad
    options fail at once: retrying cannot fix them."""
    started = time.monotonic()
    deadline = started + give_up_s
    until = time.strftime("%H:%M:%S", time.localtime(time.time() + give_up_s))
    said: list[float] = []  # when the waiting lines were logged

    def tick(error: BaseException | None = None) -> None:
        error = error or quiet.refused
        if error is None or quiet.auth_failed:
            return
        if not said:
            log.warning(
                "broker at %s not reachable yet (%s: %s); retrying until %s "
                "(bus.connect_give_up_s=%g). No broker running? Start one with `specbus up`",
                url, type(error).__name__, error, until, give_up_s,
            )  # fmt: skip
            said.append(time.monotonic())
        elif time.monotonic() - said[-1] >= PROGRESS_S:
            log.warning("still waiting for the broker at %s: %.0f s so far, until %s",
                        url, time.monotonic() - started, until)  # fmt: skip
            said.append(time.monotonic())

    while True:
        try:
            nc = await _connect_once(options, quiet, tick)
        except Exception as e:
            retryable = isinstance(e, (NoServersError, OSError, asyncio.TimeoutError))
            if not retryable or quiet.auth_failed or time.monotonic() >= deadline:
                waited = f" after {time.monotonic() - started:.0f}s" if said else ""
                why = " (Authorization Violation: the broker refused these credentials)"
                raise BusError(
                    f"cannot connect to the broker at {url}{waited}: {type(e).__name__}: {e}"
                    + (why if quiet.auth_failed else "")
                ) from e
            tick(e)
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            continue
        if said:
            log.warning("connected to %s after %.1fs", url, time.monotonic() - started)
        return nc


def _tls_context(cfg: BusConfig) -> ssl.SSLContext | None:
    if not (cfg.tls_ca or cfg.tls_cert):
        return None
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ConfigError("bus.tls_cert and bus.tls_key must be set together (mutual TLS)")
    ctx = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cafile=str(cfg.tls_ca) if cfg.tls_ca else None
    )
    if cfg.tls_cert:
        ctx.load_cert_chain(str(cfg.tls_cert), str(cfg.tls_key))
    return ctx


async def connect(cfg: BusConfig, url: str | None = None, name: str = "specbus") -> Bus:
    """Connect to `url` (default `cfg.url`). Raises `BusError` if no broker answers in time,
    `ConfigError` for a missing URL or unusable auth settings."""
    url = url or cfg.url
    if not url:
        raise ConfigError("no broker URL: pass --url, set bus.url, or start one with `specbus up`")
    quiet = _QuietErrors(name)
    # The first connection is bounded (a typo in the URL must fail, not hang); reconnects are not.
    initial_attempts = max(1, int(cfg.connect_timeout_s / cfg.reconnect_wait_s))
    options = dict(
        servers=[u.strip() for u in url.split(",") if u.strip()],
        name=name,
        connect_timeout=cfg.connect_timeout_s,
        reconnect_time_wait=cfg.reconnect_wait_s,
        max_reconnect_attempts=initial_attempts,
        error_cb=quiet.error,
        disconnected_cb=quiet.disconnected,
        reconnected_cb=quiet.reconnected,
        tls=_tls_context(cfg),
    )
    if cfg.user is not None:
        options.update(user=cfg.user, password=cfg.password or "")
    if cfg.token is not None:
        options["token"] = cfg.token
    if cfg.creds_file is not None:
        if not cfg.creds_file.exists():
            raise ConfigError(f"bus.creds_file {str(cfg.creds_file)!r} does not exist")
        options["user_credentials"] = str(cfg.creds_file)
    if cfg.nkey_file is not None:
        if not cfg.nkey_file.exists():
            raise BusError(f"bus.nkey_file {str(cfg.nkey_file)!r} does not exist")
        options["nkeys_seed"] = str(cfg.nkey_file)
    if cfg.inbox_prefix:
        options["inbox_prefix"] = cfg.inbox_prefix
    nc = await _first_connection(url, options, quiet, cfg.connect_give_up_s)
    # From now on a lost broker is retried per config (forever by default).
    nc.options["max_reconnect_attempts"] = cfg.max_reconnect_attempts
    return Bus(nc, cfg, url, quiet)
