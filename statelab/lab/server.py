"""A running llama-server as a partner: slots saved over HTTP become verified captures, and
captures (or crossed states) are restored into a server's slot.

llama-server (``tools/server`` of the pinned llama.cpp, built by ``native/server.py``) saves
and restores a slot with ``POST /slots/{id}?action=save|restore`` and a JSON body
``{"filename": NAME}``; the file lives in the folder the server was started with
(``--slot-save-path DIR``), which the server does not report, so the caller names it.  The
file is a sequence-state file (``llama_state_seq_save_file``): :mod:`statelab.lab.interop`
reads and writes it, and an import goes through the same checks as ``import-state``.

Only the standard library talks HTTP (``urllib``, no proxies, a timeout on every request);
every failure is a :class:`ServerError` of one line: the server not reachable, an HTTP
status with the server's own message, a save whose file is not where it should be.

:func:`running_server` starts a llama-server process on 127.0.0.1 (tests, the device
recipe) and stops it on exit.  The partner checks (:func:`check_slot_save`,
:func:`check_restore`, :func:`check_subset_cross`) put the lab's continuation and the
server's side by side (token ids); the tests and the device recipe run them.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from statelab.errors import ConfigError, IdentityError, StatelabError
from statelab.lab.archive import check_importable
from statelab.lab.formation import Capture
from statelab.lab.interop import export_state_file, import_incoming, incoming_from_file, read_state_file
from statelab.lab.intervene import config_of, import_and_continue, subset_cross
from statelab.models import model_sha256
from statelab.selection import apply_subset, load_selector, select

DEFAULT_TIMEOUT = 120.0  # seconds per request: a save or restore of a large context takes a while
BINARY = "llama-server"
BINARY_ENV = "STATELAB_LLAMA_SERVER"
FLASH_ATTN = ("on", "off", "auto")


class ServerError(StatelabError):
    """A llama-server could not be reached, refused a request, or answered unexpectedly."""


# --------------------------------------------------------------------------- HTTP client


def check_url(url: str) -> str:
    """``http://HOST:PORT`` (a trailing slash is dropped); anything else is refused."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/") or u.query:
        raise ConfigError(f"--url must look like http://127.0.0.1:8080, got {url!r}")
    return url.rstrip("/")


def check_slot(slot: int) -> int:
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
        raise ConfigError(f"the slot must be a non-negative integer, got {slot!r}")
    return slot


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


@dataclass(frozen=True)
class Server:
    """A llama-server's HTTP API at ``url`` (``http://HOST:PORT``)."""

    url: str
    timeout: float = DEFAULT_TIMEOUT

    def __post_init__(self):
        object.__setattr__(self, "url", check_url(self.url))
        if not self.timeout > 0:
            raise ConfigError(f"the timeout must be positive, got {self.timeout}")

    def request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        """One request; the decoded JSON answer.  Every failure is one ServerError line."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        t = self.timeout if timeout is None else timeout
        try:
            with _OPENER.open(req, timeout=t) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise ServerError(f"{method} {self.url}{path}: HTTP {e.code}: {_server_message(e)}") from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise ServerError(f"{method} {self.url}{path}: no answer within {t:g} s") from None
            raise ServerError(f"llama-server not reachable at {self.url} ({reason})") from None
        except TimeoutError:  # socket.timeout is TimeoutError
            raise ServerError(f"{method} {self.url}{path}: no answer within {t:g} s") from None
        except (ConnectionError, OSError) as e:
            raise ServerError(f"llama-server at {self.url}: connection failed ({e})") from None
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            raise ServerError(f"{method} {self.url}{path}: the answer is not JSON ({raw[:80]!r})") from None

    def health(self, timeout: float | None = None) -> dict:
        return self.request("GET", "/health", timeout=timeout)

    def props(self) -> dict:
        return self.request("GET", "/props")

    def save_slot(self, slot: int, filename: str) -> dict:
        return self.request("POST", f"/slots/{check_slot(slot)}?action=save", {"filename": filename})

    def restore_slot(self, slot: int, filename: str) -> dict:
        return self.request("POST", f"/slots/{check_slot(slot)}?action=restore", {"filename": filename})

    def completion(self, prompt, n_predict: int, slot: int | None = None, **params) -> dict:
        """Greedy ``/completion`` with the prompt cache on (``prompt``: text or token ids);
        the answer carries the generated token ids (``tokens``)."""
        body = {"prompt": [int(t) for t in prompt] if not isinstance(prompt, str) else prompt,
                "n_predict": int(n_predict), "cache_prompt": True, "temperature": 0.0, "top_k": 1,
                "return_tokens": True, "stream": False,
                "repeat_penalty": 1.0, "dry_multiplier": 0.0}
        if slot is not None:
            body["id_slot"] = check_slot(slot)
        body.update(params)
        return self.request("POST", "/completion", body)


def _server_message(e: urllib.error.HTTPError) -> str:
    try:
        raw = e.read()
    except OSError:
        raw = b""
    try:
        err = json.loads(raw).get("error", {})
        msg = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        msg = raw.decode("utf-8", "replace").strip()
    return " ".join(str(msg or e.reason).split())[:300]


# --------------------------------------------------------------------------- slot save / restore


def _slot_dir(slot_dir) -> Path:
    d = Path(slot_dir)
    if not d.is_dir():
        raise ConfigError(f"{d}: not a folder (give the server's --slot-save-path folder)")
    return d


def _transfer_name(slot: int) -> str:
    return f"statelab-slot{slot}-{os.getpid()}-{uuid.uuid4().hex[:12]}.bin"


def server_model_path(server: Server) -> Path | None:
    """The model file the server reports in ``/props`` when it exists on this machine."""
    p = server.props().get("model_path")
    return Path(p) if p and Path(p).is_file() else None


def check_server_slot(server: Server, slot: int) -> dict:
    """The server's ``/props``; ``slot`` must be one of its slots (llama-server itself takes a
    slot id modulo its slot count: slot 7 of a one-slot server would be slot 0)."""
    check_slot(slot)
    props = server.props()
    n = props.get("total_slots")
    if isinstance(n, int) and not slot < n:
        raise ServerError(f"the server at {server.url} has {n} slot{'s' if n != 1 else ''} "
                          f"(0..{n - 1}), not slot {slot}")
    return props


def check_server_model(server: Server, model, slot: int) -> dict:
    """The server's ``/props`` (``slot`` checked); its model file, when readable here, must be
    ``model``'s (sha256)."""
    props = check_server_slot(server, slot)
    p = props.get("model_path")
    if p and Path(p).is_file() and model_sha256(p) != model_sha256(model.path):
        raise IdentityError(f"the server at {server.url} runs {p}, not {model.path} (sha256 differs)")
    return props


def save_slot_capture(server: Server, slot: int, slot_dir, model, config, *, prompt=None,
                      logits: str = "recompute", source_backend: str | None = None, keep_file: bool = False) -> Capture:
    """``statelab slot save``: the server saves slot ``slot`` into ``slot_dir`` (its
    ``--slot-save-path``); the file is imported as a verified capture (the checks of
    ``import-state``; ``logits='recompute'`` re-evaluates the last token, since a slot file
    holds no logits) and removed unless ``keep_file``.  ``source_backend``: the backend the
    server runs on, when known (the server does not report it; unknown otherwise)."""
    d = _slot_dir(slot_dir)
    props = check_server_model(server, model, slot)
    name = _transfer_name(slot)
    path = d / name
    try:
        answer = server.save_slot(slot, name)
        if not path.is_file():
            raise ServerError(f"the server saved slot {slot} as {name!r} but {d} holds no such file: is {d} the "
                              "folder the server was started with (--slot-save-path)? (the server's copy stays in "
                              "its own folder)")
        written = answer.get("n_written")
        if written is not None and path.stat().st_size != int(written):
            raise ServerError(f"{path}: {path.stat().st_size} bytes, the server wrote {written}")
        if not answer.get("n_saved"):
            raise ServerError(f"slot {slot} of {server.url} is empty (the server saved 0 tokens)")
        inc = incoming_from_file(read_state_file(path))
        origin = dict(inc.origin, format=f"llama-server slot save ({inc.origin['format']})",
                      server={"url": server.url, "slot": slot, "n_saved": answer.get("n_saved"),
                              "build_info": props.get("build_info"), "model_path": props.get("model_path")})
        if keep_file:
            origin["server"]["file"] = str(path)
        inc = replace(inc, origin=origin, source=str(path))
        return import_incoming(inc, model, config, prompt=prompt, logits=logits, source_backend=source_backend)
    finally:
        if not keep_file:
            path.unlink(missing_ok=True)


def restore_capture(server: Server, slot: int, capture: Capture, slot_dir, *, n_stream: int = 1,
                    keep_file: bool = False) -> dict:
    """``statelab slot restore``: ``capture`` written as a sequence-state file into
    ``slot_dir`` (the server's ``--slot-save-path``) and restored into slot ``slot``; the
    server's answer (``n_restored`` must be the capture's token count)."""
    d = _slot_dir(slot_dir)
    check_server_slot(server, slot)
    name = _transfer_name(slot)
    path = d / name
    export_state_file(capture, path, "seq", n_stream=n_stream)
    try:
        try:
            answer = server.restore_slot(slot, name)
        except ServerError as e:
            if "HTTP" in str(e) and ("invalid slot save file" in str(e) or "failed to open" in str(e)):
                raise ServerError(f"{e} (is {d} the folder the server was started with, --slot-save-path?)") from None
            raise
        if int(answer.get("n_restored", -1)) != capture.n_prompt:
            raise ServerError(f"the server restored {answer.get('n_restored')} tokens into slot {slot}, "
                              f"the capture holds {capture.n_prompt}")
        return answer
    finally:
        if not keep_file:
            path.unlink(missing_ok=True)


def continue_in_server(server: Server, slot: int, tokens, first: int, n_predict: int) -> list[int]:
    """After a restore, the server continues the way the common receiver does: the pending
    token ``first`` (the greedy token of the capture's logits) is decoded once at the position
    after the restored cells, then ``n_predict`` tokens are generated.  Returns ``[first, ...]``.
    The server must have reused every restored cell (``timings.prompt_n`` == 1)."""
    seq = [int(t) for t in tokens] + [int(first)]
    r = server.completion(seq, n_predict, slot=slot)
    n_processed = (r.get("timings") or {}).get("prompt_n")
    if n_processed != 1:
        raise ServerError(f"the server re-processed {n_processed} prompt tokens instead of reusing the restored "
                          f"{len(seq) - 1} (was the slot restored, with the same tokens?)")
    return [int(first)] + [int(t) for t in r.get("tokens", [])]


# --------------------------------------------------------------------------- a server process


def server_binary(explicit=None) -> Path:
    """The llama-server binary: ``explicit``, ``$STATELAB_LLAMA_SERVER``, the one
    ``native/server.py`` installed beside this interpreter, or ``llama-server`` on PATH."""
    named = explicit or os.environ.get(BINARY_ENV)
    for cand in [named] if named else [Path(sys.prefix) / "bin" / BINARY, shutil.which(BINARY)]:
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return Path(cand)
    if named:
        raise ConfigError(f"llama-server binary not found or not executable: {named}")
    raise ConfigError("no llama-server binary: build it with `python native/server.py` (install.sh does), "
                      f"or set {BINARY_ENV}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A llama-server started by :func:`running_server`."""

    server: Server
    slot_dir: Path
    process: subprocess.Popen
    log: Path
    argv: list

    @property
    def url(self) -> str:
        return self.server.url

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def server_argv(binary, model_path, port: int, slot_dir, *, n_ctx: int = 1024, parallel: int = 1,
                flash_attn: str = "auto", threads: int | None = None, extra=()) -> list[str]:
    if flash_attn not in FLASH_ATTN:
        raise ConfigError(f"flash_attn must be one of {', '.join(FLASH_ATTN)}, got {flash_attn!r}")
    argv = [str(binary), "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port),
            "--slot-save-path", str(slot_dir), "-c", str(n_ctx), "-np", str(parallel), "--no-webui",
            "-fa", flash_attn]
    if threads:
        argv += ["-t", str(threads)]
    return argv + [str(a) for a in extra]


@contextmanager
def running_server(model_path, slot_dir=None, *, binary=None, n_ctx: int = 1024, parallel: int = 1,
                   flash_attn: str = "auto", threads: int | None = None, extra=(), startup_timeout: float = 120.0):
    """Start llama-server on 127.0.0.1 (a free port) with ``--slot-save-path slot_dir`` (a new
    temporary folder when None), wait until ``/health`` answers 200, yield a
    :class:`ServerProcess`; stop the process (SIGTERM, then SIGKILL) on exit."""
    binary = server_binary(binary)
    own_dir = slot_dir is None
    d = Path(tempfile.mkdtemp(prefix="statelab-slots-")) if own_dir else _slot_dir(slot_dir)
    log = Path(tempfile.mkstemp(prefix="statelab-llama-server-", suffix=".log")[1])
    argv = server_argv(binary, model_path, free_port(), d, n_ctx=n_ctx, parallel=parallel,
                       flash_attn=flash_attn, threads=threads, extra=extra)
    port = int(argv[argv.index("--port") + 1])
    with open(log, "wb") as lf:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=lf, stderr=subprocess.STDOUT,
                                start_new_session=True)
    sp = ServerProcess(Server(f"http://127.0.0.1:{port}"), d, proc, log, argv)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise ServerError(f"llama-server exited with status {proc.returncode} while starting: "
                                  + " | ".join(sp.log_tail(5).splitlines()))
            try:
                sp.server.health(timeout=2)
                break
            except ServerError:  # not listening yet, or 503 while the model loads
                if time.monotonic() > deadline:
                    raise ServerError(f"llama-server did not become healthy within {startup_timeout:g} s: "
                                      + " | ".join(sp.log_tail(5).splitlines())) from None
                time.sleep(0.2)
        yield sp
    finally:
        _stop(proc)
        log.unlink(missing_ok=True)
        if own_dir:
            shutil.rmtree(d, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and nothing else
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def greedy_first(capture: Capture) -> int:
    """The pending token of the common receiver: the greedy token of the capture's logits."""
    lg = np.asarray(capture.logits)
    if not np.all(np.isfinite(lg)):
        raise ConfigError("the capture has no initial logits (imported without them): nothing to continue from")
    return int(np.argmax(lg))


# --------------------------------------------------------------------------- partner checks


@dataclass
class PartnerCheck:
    """One state continued by the lab and by the server: both token lists, and what was done."""

    name: str
    lab: list
    server: list
    detail: dict

    @property
    def equal(self) -> bool:
        return self.lab == self.server

    def as_dict(self) -> dict:
        return {"check": self.name, "equal": self.equal, "lab": self.lab, "server": self.server, **self.detail}


def lab_continuation(model, capture: Capture, cap: int) -> list[int]:
    """The common receiver's tokens from ``capture`` in its own recorded path."""
    config = config_of(capture)
    check_importable(capture, model, config)
    ep = import_and_continue(model, config, capture.blob, capture.logits, capture.n_prompt, cap)
    return [int(t) for t in ep.tokens]


def check_slot_save(server: Server, slot_dir, model, config, prompt: str, cap: int, slot: int = 0,
                    n_first: int = 4) -> tuple[PartnerCheck, Capture]:
    """(a) The server completes ``prompt`` (``n_first`` greedy tokens, prompt cache on) and
    saves the slot over HTTP; the import continues in the lab (``cap`` tokens, logits
    recomputed) and the server continues from the cells it saved (its pending token, then
    ``cap - 1`` more).  The server runs on ``config.backend``.  Also returns the imported capture."""
    server.request("POST", f"/slots/{check_slot(slot)}?action=erase")
    r = server.completion(prompt, n_first, slot=slot)
    gen, n_prompt = [int(t) for t in r.get("tokens", [])], int(r.get("tokens_evaluated", -1))
    capture = save_slot_capture(server, slot, slot_dir, model, config, source_backend=config.backend)
    k = capture.n_prompt - n_prompt  # generated tokens the server decoded into the slot
    if not 0 <= k < len(gen) or [int(t) for t in capture.tokens[n_prompt:]] != gen[:k]:
        raise ServerError(f"the saved slot holds {capture.n_prompt} tokens, not the {n_prompt} prompt tokens and "
                          f"a part of the {len(gen)} generated ones")
    lab = lab_continuation(model, capture, cap)
    theirs = continue_in_server(server, slot, capture.tokens, gen[k], cap - 1)
    return PartnerCheck("slot save -> import -> continue", lab, theirs,
                        {"n_prompt": n_prompt, "generated": gen, "n_saved": capture.n_prompt,
                         "same_as_first_generation": lab[:len(gen) - k] == gen[k:],
                         "v_trans": bool(capture.state.v_trans)}), capture


def check_restore(server: Server, slot_dir, model, capture: Capture, cap: int, slot: int = 0) -> PartnerCheck:
    """(b) ``capture`` continued by the lab, and restored into the server's slot and continued there."""
    lab = lab_continuation(model, capture, cap)
    answer = restore_capture(server, slot, capture, slot_dir)
    theirs = continue_in_server(server, slot, capture.tokens, greedy_first(capture), cap - 1)
    return PartnerCheck("capture -> restore -> continue", lab, theirs,
                        {"n_restored": answer.get("n_restored"), "v_trans": bool(capture.state.v_trans)})


def check_subset_cross(server: Server, slot_dir, model, donor: Capture, recipient: Capture, selector: str,
                       cap: int, slot: int = 0) -> PartnerCheck:
    """(c) The lab's subset cross (``selector``'s values from ``donor``, the recipient's
    logits kept) against the same crossed state restored into the server and continued there."""
    sel = select(load_selector(selector), recipient.state)
    ep, acc = subset_cross(model, donor, recipient, sel, cap)
    crossed = recipient.with_blob(apply_subset(recipient.state, donor.state, sel).to_bytes())
    answer = restore_capture(server, slot, crossed, slot_dir)
    theirs = continue_in_server(server, slot, crossed.tokens, greedy_first(recipient), cap - 1)
    return PartnerCheck(f"subset cross {selector} -> restore -> continue", [int(t) for t in ep.tokens], theirs,
                        {"n_restored": answer.get("n_restored"), "selected_bytes": acc.selected_bytes,
                         "changed_bytes": acc.changed_bytes, "first_differing_layer": acc.first_differing_layer,
                         "recipient_first": greedy_first(recipient)})
