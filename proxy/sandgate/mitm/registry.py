"""Every patch of mitmproxy (h11, h2, wsproto, pyOpenSSL) internals, in the order it is installed.

`PATCHES` is the one list: each entry names the module that patches, why (one line), and each
object it replaces, wraps or copies from ("module:Qualified.name") with the SHA-256 of that
object's source in the pinned library versions (sandgate.mitm.pinning). A library upgrade that
changes one of those sources fails the named test of exactly the patches that depend on it
(tests/unit/test_mitm_registry.py), so the patch is read and re-checked, never trusted.

`install_all` installs them in this order, once, on a freshly built master (no addons yet: the
first entry replaces its addon manager). Where several patches wrap the same attribute, the
list's order is the wrapping order: a later entry wraps the earlier ones, so its wrapper runs
first (ConnectionHandler.open_connection: upstreampool, then dialguard, then wirelimits, then
mitmproxy's). The table in docs/reference/patches.md is rendered from this list.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from mitmproxy import master

from sandgate.limits import LimitsConfig
from sandgate.mitm import pinning
from sandgate.mitm.guards import (
    admission,
    corrections,
    dialguard,
    dialorigin,
    readable,
    socks5,
    tunnels,
    wirelimits,
    wscontrol,
)
from sandgate.mitm.speedups import (
    coalesce,
    dispatch,
    handshake,
    headerlookup,
    relay,
    sharedport,
    speed,
    synchooks,
    upstreampool,
    writes,
)


@dataclass(frozen=True)
class Wiring:
    """What the patches are installed with."""

    master: master.Master
    limits: LimitsConfig
    on_event: wirelimits.OnEvent | None = None
    worker: bool = False  # a --workers child (the patches marked only_in_workers apply)


@dataclass(frozen=True)
class Pin:
    """One object a patch replaces, wraps or copies from, and the SHA-256 of its source."""

    target: str
    sha256: str

    def current(self) -> str:
        return hashlib.sha256(pinning.source(self.target).encode()).hexdigest()


@dataclass(frozen=True)
class Patch:
    """One patch: its module (sandgate.mitm.guards or .speedups), why, what it pins, and how it
    is installed."""

    name: str
    module: ModuleType
    reason: str
    pins: tuple[Pin, ...]
    install: Callable[[Wiring], object]
    # If set, the pins are verified again at start, not only by the tests: on other code
    # Sandgate refuses to start, with this message.
    checked_at_start: str = ""
    # Installed in --workers children only (install_all(worker=True)); a single process runs
    # mitmproxy's own code there.
    only_in_workers: bool = False

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(p.target for p in self.pins)

    @property
    def kind(self) -> str:
        return self.module.__name__.split(".")[-2]  # guards | speedups

    def changed(self) -> list[str]:
        """The targets whose source is no longer the pinned one."""
        return [p.target for p in self.pins if p.current() != p.sha256]

    def sources(self) -> str:
        """What the patch was checked against, to read next to a new version's diff."""
        return pinning.sources(self.targets)


_WSCONTROL_CHANGED = ("mitmproxy's or wsproto's WebSocket code is not the one Sandgate's "
                      "control-frame patch was written for (sandgate.mitm.guards.wscontrol)")

PATCHES: tuple[Patch, ...] = (
    # What it depends on: the manager whose dispatch it caches, and the helpers it calls the same
    # way.
    Patch("dispatch", dispatch,
          "hook lookup once per event name, not once per event (~10% of the CPU)", (
        Pin("mitmproxy.addonmanager:AddonManager",
            "34d29a59f1409df52271937e209b4a28a9b1b0a6b4940af9580b9c77a67f01ec"),
        Pin("mitmproxy.addonmanager:safecall",
            "b54a129802a53182f7a0a522bcc32c26a6d81649dca80c45971180cb8fd8be8a"),
        Pin("mitmproxy.addonmanager:traverse",
            "7235ad007525990a38d832aefe90dd789886bb3ee95b250c1fad1c0f052a0f79"),
        Pin("mitmproxy.hooks:UpdateHook",
            "70e843401064a8dba631498272c37d5c88c7efe74ecbe6285a320bf481ca5f34"),
    ), lambda w: dispatch.install(w.master)),
    # What it depends on: the SOCKS5 layer subclassed and the mode that makes it.
    Patch("socks5", socks5,
          "the SOCKS5 mode's top layer: a token required, each CONNECT judged by the gate", (
        Pin("mitmproxy.proxy.layers.modes:Socks5Proxy",
            "3c49a80cecbb733b829dee200503c97e71d91d9aefaedf3ead526d68c799f709"),
        Pin("mitmproxy.proxy.mode_servers:Socks5Instance",
            "03c867b702f648d26093ef727dda33fda1f8b372897c89816b1aabb823ff4049"),
    ), lambda w: socks5.install()),
    # What it depends on: the error pages and where they are sent (HTTP/1, HTTP/2, HTTP/3 is off),
    # the status of an error code, the HTTP/1 body reader and the body size check.
    Patch("corrections", corrections,
          "mitmproxy's error pages, HTTP/1 trailers and response body limit corrected", (
        Pin("mitmproxy.proxy.layers.http._http1:make_error_response",
            "1ebe7083b78d5937e3db683086cecb8121a4238e43edbee4dd71d16bd9ddcd00"),
        Pin("mitmproxy.proxy.layers.http._http1:Http1Connection._handle_event",
            "4ca054b2c051446b6e46186ce4d8b1f68a581bacff82e5df58c83ef3abdb9428"),
        Pin("mitmproxy.proxy.layers.http._http1:Http1Server.send",
            "eaaa373dedd307e231a1b4969a94548578e128c2a7f4e9c9eb12313a7145fe29"),
        Pin("mitmproxy.proxy.layers.http._http1:make_body_reader",
            "ebebb6e1a1e8005fa3f90276af9f4f7ed2d5514c18abe446601c0fc430ea66f1"),
        Pin("mitmproxy.proxy.layers.http._base:format_error",
            "48483a2fe6efb5a745d6b18947fa265ac3479fc1e24df0ecd99caa878b3917fd"),
        Pin("mitmproxy.proxy.layers.http._http2:Http2Connection._handle_event",
            "c69f38651c4d6a7a483bc93d2b35cc5f351602751ef5fe79993cb5eb1232a1ce"),
        Pin("mitmproxy.proxy.layers.http._events:ErrorCode.http_status_code",
            "1df77d6963dc65c6653228a4b83a1190ca2d6e2d7a4b35f8ffc120dcb7632041"),
        Pin("mitmproxy.proxy.layers.http:HttpStream.check_body_size",
            "97eed8962223617a2e86bb0a4c79786555418248886ccf7e9327f0b2d7b615af"),
        Pin("h11._events:EndOfMessage",
            "c49ca455a432fff4229c9a38a0d3217ef3d292d0d87cc073433feaf8d8c5ff4b"),
    ), lambda w: corrections.install()),
    # What it depends on: the layer's relay loop and wsproto's event reader.
    Patch("wscontrol", wscontrol,
          "WebSocket ping, pong and close payloads judged and scrubbed like messages", (
        Pin("mitmproxy.proxy.layers.websocket:WebsocketLayer.relay_messages",
            "e800d709617e904212d82a13a63e63f8413836899844053df00f96c7dd802284"),
        Pin("wsproto.connection:Connection.events",
            "cdd011735d7f57aa414fa62a228d89b658f9a7b88f7846929faa2ad1e6dead29"),
    ), lambda w: wscontrol.install(),
          checked_at_start=_WSCONTROL_CHANGED),
    # What it depends on: the connection handler's client task, which admission wraps.
    Patch("admission", admission,
          "an unidentified client holds a connection slot only briefly", (
        Pin("mitmproxy.proxy.server:ConnectionHandler.handle_client",
            "a460e7dd21798856698b812d38067cb685baaee703b04f090635f85e0c69f370"),
    ), lambda w: admission.install(w.limits, wirelimits.admission_closed)),
    # What it depends on: h11's chunk reader and the HTTP/1 server side it wraps.
    Patch("readable", readable,
          "what a refusal answers is what the client reads: drained, then closed", (
        Pin("h11._readers:ChunkedReader",
            "f4672e4e971c7871cd1ec142cfe63252bb69eac92ef53b8ac701048a9a369f73"),
        Pin("mitmproxy.proxy.layers.http._http1:Http1Connection._handle_event",
            "4ca054b2c051446b6e46186ce4d8b1f68a581bacff82e5df58c83ef3abdb9428"),
        Pin("mitmproxy.proxy.layers.http._http1:Http1Server.send",
            "eaaa373dedd307e231a1b4969a94548578e128c2a7f4e9c9eb12313a7145fe29"),
        Pin("mitmproxy.proxy.layers.http._http1:Http1Connection.read_body",
            "9d64abb7fef741e6de4974fba92341c532eeeb38b91efbbdd20bef2a4e3e3bec"),
        Pin("mitmproxy.proxy.layers.http:HttpStream.state_wait_for_request_headers",
            "9cdaef99dc08cac5340e8c968a479f7ed341cbecaf134aa6b4c1a278657e1801"),
    ), lambda w: readable.install()),
    # What it depends on: every function wrapped.
    Patch("wirelimits", wirelimits,
          "head sizes and timeouts bounded below the hooks, where no hook reaches", (
        Pin("mitmproxy.proxy.layers.http._http1:Http1Server.read_headers",
            "23fa629cea80477dccbd8955f1011c57e24e0ac824ed16fb4eeded4e4cf1905b"),
        Pin("mitmproxy.proxy.layers.http._http1:Http1Connection._handle_event",
            "4ca054b2c051446b6e46186ce4d8b1f68a581bacff82e5df58c83ef3abdb9428"),
        Pin("mitmproxy.proxy.layers.http._http1:Http1Client.read_headers",
            "4cdd1074c958931338d52f9895caf8653fd83cdd81daea3d8435aed8c1ad4cce"),
        Pin("mitmproxy.proxy.layers.http._http_h2:BufferedH2Connection.__init__",
            "6c935e8d58ea1ea6497b35c25619aa20b6080820668e176d63967fe8a8d27c51"),
        Pin("h2.frame_buffer:FrameBuffer._update_header_buffer",
            "8254599f437805d2935db85f760f225ce6868299e48846442228ee6ce157604f"),
        Pin("mitmproxy.proxy.server:ConnectionHandler.open_connection",
            "cef8d73a19a787df732b7334863e94d0a001b1cbb97bf1b4c882557bd4ca030a"),
        Pin("mitmproxy.proxy.server:ConnectionHandler.on_timeout",
            "05db80a3824df86f0a6176ac7c9b8614ff915ebb4844b082f53eb27a3b245992"),
        Pin("mitmproxy.proxy.tunnel:TunnelLayer._handshake_finished",
            "8b2bba7d252cee635046a08ab01edcabfcf77092453c2c25ab74ff3677778531"),
        Pin("mitmproxy.proxy.layers.http:HttpStream.handle_protocol_error",
            "16ebb14649f2940b480fa736b920b61eb3d26d7415df8f41bff132ed58d53b51"),
    ), lambda w: wirelimits.install(w.limits, w.on_event)),
    # What it depends on: the dial task it guards.
    Patch("dialguard", dialguard,
          "every upstream dial gets its answer, even when its task dies", (
        Pin("mitmproxy.proxy.server:ConnectionHandler.open_connection",
            "cef8d73a19a787df732b7334863e94d0a001b1cbb97bf1b4c882557bd4ca030a"),
    ), lambda w: dialguard.install()),
    # What it depends on: the connection loop `handle_connection` copies, and the TCP layer it
    # skips.
    Patch("relay", relay,
          "a verified passthrough tunnel piped past mitmproxy's layers", (
        Pin("mitmproxy.proxy.server:ConnectionHandler.handle_connection",
            "f9faab6ad3ed5b81f037b482742b27a348b3f5c42c453a146204e25faf2b96e0"),
        Pin("mitmproxy.proxy.layers.tcp:TCPLayer",
            "6c54a263c1dc9aa325bf527b6c5b99a4ce2c9ad1f57f83bdf82d8a770db55f12"),
        Pin("mitmproxy.proxy.server:TimeoutWatchdog",
            "c369d9acd4797ef487d3f616a9e5be60e410fef5a0243a472a19a27c0af47eb1"),
    ), lambda w: relay.install()),
    # What it depends on: the CONNECT handling it wraps.
    Patch("tunnels", tunnels,
          "one tunnel record (and upstream) per CONNECT stream, not per connection", (
        Pin("mitmproxy.proxy.layers.http:HttpStream.handle_connect",
            "b95b35f62d16828e1813dfe38709d276307a73294c1f01b3e8dc3f953a8a2628"),
        Pin("mitmproxy.proxy.layers.http._http2:parse_h2_request_headers",
            "3b472fcd96e294c8356f980c78dcdc45726f898400732d2c9ef63502a15033b2"),
    ), lambda w: tunnels.install()),
    # What it depends on: where an HTTP layer makes an upstream connection.
    Patch("dialorigin", dialorigin,
          "each upstream dial knows the flow that asked for it", (
        Pin("mitmproxy.proxy.layers.http:HttpLayer.get_connection",
            "735692cf8c26eb9fbf27d3fcd152ed4706d5755764c2240203e1a502a6e080c4"),
    ), lambda w: dialorigin.install()),
    # What it depends on: the handler whose writers are batched.
    Patch("writes", writes,
          "one socket write per connection per event", (
        Pin("mitmproxy.proxy.server:ConnectionHandler.__init__",
            "f695401fcc32e556478b2d137ea48bb13055fb6ebdb9ac1736fcd6efa43a3e33"),
        Pin("mitmproxy.proxy.server:ConnectionHandler.server_event",
            "ffbed451b4933f30d26bc1e2b1cb0a1c3f9ec7b94bb32a742f6faec3604b8cc0"),
        Pin("mitmproxy.proxy.server:ConnectionIO",
            "5b3a3a1427b5d92d53364e36c6b3ea84d3ce7417eb33f9b0d8e1d10ff1f5bc76"),
    ), lambda w: writes.install()),
    # What it depends on: `server_event` is a copy of mitmproxy's, and the hook task it skips.
    Patch("synchooks", synchooks,
          "hooks no handler awaits in run at once, without a task each", (
        Pin("mitmproxy.proxy.server:ConnectionHandler.server_event",
            "ffbed451b4933f30d26bc1e2b1cb0a1c3f9ec7b94bb32a742f6faec3604b8cc0"),
        Pin("mitmproxy.proxy.server:ConnectionHandler.hook_task",
            "e5e55c36c342d63d1eee5c20a6bd5865925fdafef313b8591d516b570fea1f6e"),
    ), lambda w: synchooks.install()),
    # What it depends on: the functions replaced.
    Patch("speed", speed,
          "work Sandgate does not need turned off (inert addons, debug type checks)", (
        Pin("mitmproxy.http:MessageData",
            "2fe4b7f15ac77ea339c2e74f75d53e8433ceeb92db5759257ae802236526c10f"),
        Pin("mitmproxy.proxy.context:Context",
            "5ac45be9bd6de7d4f90c990928e61b46742b80b06fe765f084f8bf6182d726ae"),
        Pin("mitmproxy.hooks:Hook.args",
            "d94d401aa3ea703f10d0685ccad2789648267973f2643088933df0321152f0d3"),
        Pin("mitmproxy.optmanager:_Option.current",
            "196ad8eb1621cb70c7c9fae3f2057dc01a38b51a0beacc6b642975f819427952"),
    ), lambda w: speed.install()),
    # What it depends on: where mitmproxy hands the certificate and key over, pyOpenSSL's
    # conversions, and the task debug names.
    Patch("handshake", handshake,
          "certificate and key conversions done once per object, not per handshake", (
        Pin("mitmproxy.addons.tlsconfig:TlsConfig.tls_start_client",
            "3f5f8c5637d5f902d09a7289688a10557aceed1cbc94309bf2f67ed6f6bf415d"),
        Pin("mitmproxy.certs:CertStore.get_cert",
            "fbbd972c83c2e6b022749498707f072daef24e34d8e678562d79c06dce90c0fa"),
        Pin("OpenSSL.SSL:Connection.use_certificate",
            "722434e2224bf088a55532cc6c4fed1911afe421020eabd0f6eee256283dc107"),
        Pin("OpenSSL.SSL:Connection.use_privatekey",
            "43ab725d635c2286a9fff37b7c3d45c88240f11a5a1fac2ea9889bcbf24bc9e0"),
        Pin("mitmproxy.utils.asyncio_utils:create_task",
            "18c03f6f52c5c6413ad9edd534ed8dffbba640ec297d06e3a26d46f33fa0422e"),
        Pin("mitmproxy.utils.asyncio_utils:set_task_debug_info",
            "40112e6fb1b60d2fe03c02a3f2b6b03bcfb3e760eed1337689ee79845103acc7"),
    ), lambda w: handshake.install()),
    # What it depends on: the lookups replaced and what they must answer like.
    Patch("headerlookup", headerlookup,
          "header lookups with the same answers and fewer steps (~4% of the CPU)", (
        Pin("mitmproxy.http:Headers",
            "4241fa2481347a600a4d66dbfe881e3ae5b2e5b4aa62708843963295dd41b025"),
        Pin("mitmproxy.coretypes.multidict:_MultiDict.get_all",
            "1356945d453452842a37aa762301060378907963ca8ba4a773e7ab8a1bbf675b"),
        Pin("mitmproxy.coretypes.multidict:_MultiDict.__getitem__",
            "b927da74a4b87d25283fab302963c5f2da517cfb87b5151990ccb48527ede6c4"),
        Pin("mitmproxy.coretypes.multidict:MultiDict",
            "e6b8a085114a0c65d36e202d43b04c2816626536ad7ddc8239a18fc6429e6a64"),
    ), lambda w: headerlookup.install()),
    # What it depends on: the HTTP layer's event handling, whose commands are joined.
    Patch("coalesce", coalesce,
          "a message's head and body leave as one piece of data, one TLS record", (
        Pin("mitmproxy.proxy.layers.http:HttpLayer._handle_event",
            "f675d84e3db323850d5da9c0eebb641a9f756258124216c21af9335f39223009"),
    ), lambda w: coalesce.install()),
    # What it depends on: where connections are asked for, made and dialled.
    Patch("upstreampool", upstreampool,
          "idle upstream connections reused by the same caller's next connection", (
        Pin("mitmproxy.proxy.layers.http:HttpLayer.get_connection",
            "735692cf8c26eb9fbf27d3fcd152ed4706d5755764c2240203e1a502a6e080c4"),
        Pin("mitmproxy.proxy.server:ConnectionHandler.__init__",
            "f695401fcc32e556478b2d137ea48bb13055fb6ebdb9ac1736fcd6efa43a3e33"),
        Pin("mitmproxy.proxy.server:ConnectionHandler.open_connection",
            "cef8d73a19a787df732b7334863e94d0a001b1cbb97bf1b4c882557bd4ca030a"),
        # what an idle HTTP/2 session is made of (_h2_idle)
        Pin("mitmproxy.proxy.layers.http._http2:Http2Client.__init__",
            "71099bca7b09e868c207ecc092b41d3775ab390795cb2dfec16b5364691d48ff"),
        Pin("mitmproxy.proxy.layers.http._http_h2:BufferedH2Connection.__init__",
            "6c935e8d58ea1ea6497b35c25619aa20b6080820668e176d63967fe8a8d27c51"),
        Pin("h2.frame_buffer:FrameBuffer.__init__",
            "e53024e8d09f3e1fd58f40f60a85e76609ca58ce62f39eda4b4d91864d3c4a4f"),
    ), lambda w: upstreampool.install(w.limits.upstream_reuse_idle)),
    # What it depends on: the listen() it replaces, and the modes that inherit it (one that
    # came to override it would no longer share the port).
    Patch("sharedport", sharedport,
          "--workers: every worker listens on the one proxy port (SO_REUSEPORT)", (
        Pin("mitmproxy.proxy.mode_servers:AsyncioServerInstance.listen",
            "8e459ae256c4edc62c0ce228cc532b8f17a61abc6e85847dcca42347382877cb"),
        Pin("mitmproxy.proxy.mode_servers:RegularInstance",
            "bf570354a91a711d89c98897037234c05c3b21e5bb2a323f86e4858a5e965a68"),
        Pin("mitmproxy.proxy.mode_servers:Socks5Instance",
            "03c867b702f648d26093ef727dda33fda1f8b372897c89816b1aabb823ff4049"),
        Pin("mitmproxy.proxy.mode_servers:ReverseInstance",
            "a399cceb659cb432ab1826eda7427598828feacf746aeeff2a8b33dd4d68258a"),
        Pin("mitmproxy.proxy.mode_servers:TransparentInstance",
            "0db2f3194b33d140b564b672707461e2f943e57ac07e5ed53453d7fbc0616d90"),
    ), lambda w: sharedport.install(), only_in_workers=True),
)


def patch(name: str) -> Patch:
    for p in PATCHES:
        if p.name == name:
            return p
    raise LookupError(f"no patch named {name!r} in sandgate.mitm.registry.PATCHES")


def install_all(m: master.Master, limits: LimitsConfig,
                on_event: wirelimits.OnEvent | None = None, *,
                worker: bool = False) -> dispatch.CachedAddons:
    """Install every patch in `PATCHES` order on a master that has no addons yet; return its
    (cached) addon manager. Idempotent per patch; the limits are always the latest. `worker`:
    this process is a --workers child (the patches `only_in_workers` too). The caller has
    checked the library versions first (pinning.check_version: sandgate.runner.build)."""
    wiring = Wiring(m, limits, on_event, worker)
    for p in PATCHES:
        if p.only_in_workers and not worker:
            continue
        if p.checked_at_start and p.changed():
            raise RuntimeError(p.checked_at_start)
        p.install(wiring)
    assert isinstance(m.addons, dispatch.CachedAddons)
    return m.addons
