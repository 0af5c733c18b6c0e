"""The one boundary for foreign errors (``_base/foreign.py``): torch's, Gloo's, TCPStore's
and nccl4py's exceptions become the contract's, by type first, by the one message table
second, with the original kept as ``__cause__``."""

from __future__ import annotations

import ast
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

import asynccoll as ac
from asynccoll._backends.nccl import NcclError
from asynccoll._base import foreign
from asynccoll._base.foreign import Kind, creation_error, kind_of, nccl_kind, op_error
from tests.support.paths import ROOT

# Messages as torch 2.13.0 gives them (measured on this machine's CPU build).
GLOO_PEER_DIED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:20873. This is typically caused by a remote worker crashing."
)
GLOO_OP_TIMED_OUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "1000ms for recv operation to complete"
)
PORT_IN_USE = (
    "The server socket has failed to listen on any local network address. port: 29500, "
    "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
)
CONNECT_TIMED_OUT = (
    "The client socket has timed out after 1000ms while trying to connect to (127.0.0.1, 29500)."
)
SERVER_GONE = "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?"
STORE_WAIT_TIMED_OUT = "wait timeout after 1000ms, keys: /missing"


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        # By type.
        (TimeoutError(), Kind.TIMEOUT),
        (ConnectionResetError("reset"), Kind.PEER),
        (dist.DistStoreError(STORE_WAIT_TIMED_OUT), Kind.TIMEOUT),
        (dist.DistNetworkError(SERVER_GONE), Kind.PEER),
        (dist.DistNetworkError("Broken pipe"), Kind.PEER),
        # DistNetworkError stands for all three: the table tells them apart.
        (dist.DistNetworkError(PORT_IN_USE), Kind.IN_USE),
        (dist.DistNetworkError(CONNECT_TIMED_OUT), Kind.TIMEOUT),
        (dist.DistNetworkError("Connection refused"), Kind.PEER),
        # Gloo's plain RuntimeError and DistBackendError: the table only.
        (RuntimeError(GLOO_PEER_DIED), Kind.PEER),
        (RuntimeError(GLOO_OP_TIMED_OUT), Kind.TIMEOUT),
        (dist.DistBackendError("Watchdog caught collective operation timeout"), Kind.TIMEOUT),
        (dist.DistBackendError("NCCL communicator was aborted"), None),
        (RuntimeError("Invalid scalar type"), None),
        # Text is read only where torch gives no type: never of other exceptions.
        (ValueError("connection closed"), None),
        (TypeError("timed out"), None),
    ],
)
def test_torch_errors_are_read_by_type_then_by_the_table(
    exc: BaseException, kind: Kind | None
) -> None:
    assert kind_of(exc) is kind


def test_torch_errors_read_from_the_real_store() -> None:
    """The same types, raised by a real TCPStore here (torch 2.13: the table's source)."""
    store = dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=timedelta(seconds=1), wait_for_workers=False
    )
    with pytest.raises(dist.DistStoreError) as waited:
        store.wait(["never"], timedelta(milliseconds=100))
    assert kind_of(waited.value) is Kind.TIMEOUT
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(dist.DistNetworkError) as taken:
            dist.TCPStore("127.0.0.1", busy.getsockname()[1], 1, True, timeout=timedelta(seconds=1))
    assert kind_of(taken.value) is Kind.IN_USE


@pytest.mark.parametrize(
    ("exc", "expect"),
    [
        (RuntimeError(GLOO_PEER_DIED), ac.PeerFailure),
        (RuntimeError(GLOO_OP_TIMED_OUT), ac.CollectiveTimeout),
        (dist.DistNetworkError(SERVER_GONE), ac.PeerFailure),
        (dist.DistStoreError(STORE_WAIT_TIMED_OUT), ac.CollectiveTimeout),
        (dist.DistBackendError("NCCL communicator was aborted"), ac.CommAborted),
        (RuntimeError("Invalid scalar type"), ac.CommAborted),
    ],
)
def test_a_failed_op_becomes_a_comm_aborted_with_its_cause(
    exc: BaseException, expect: type
) -> None:
    err = op_error(exc, kind_of(exc), backend="gloo", seq=7, op="all_reduce")
    assert type(err) is expect and err.__cause__ is exc
    assert "all_reduce (seq 7)" in str(err) and str(exc) in str(err)
    if isinstance(err, ac.CollectiveTimeout):
        assert (err.seq, err.op) == (7, "all_reduce")


def test_a_contract_error_crosses_the_boundary_as_it_is() -> None:
    for err in (
        ac.CommAborted("aborted"),
        ac.PeerFailure("died", [1]),
        ac.CollectiveTimeout("late", 3, "send"),
    ):
        assert op_error(err, kind_of(err), backend="gloo", seq=3, op="send") is err


@pytest.mark.parametrize(
    ("exc", "expect"),
    [
        (dist.DistStoreError(STORE_WAIT_TIMED_OUT), ac.CollectiveTimeout),
        (RuntimeError(GLOO_PEER_DIED), ac.PeerFailure),
        (RuntimeError("something else broke"), ac.CommAborted),
    ],
)
def test_a_failed_creation_says_whether_the_peers_came(exc: BaseException, expect: type) -> None:
    err = creation_error(exc, kind_of(exc), what="creation", timeout=5.0)
    assert type(err) is expect and err.__cause__ is exc and str(err).startswith("creation")
    if expect is ac.CollectiveTimeout:
        assert "did not arrive within 5.0 s" in str(err)
    other = creation_error(exc, kind_of(exc), what="NCCL init", otherwise=ac.BackendUnavailable)
    assert type(other) is (ac.BackendUnavailable if expect is ac.CommAborted else expect)


# ------------------------------------------------------------------- nccl4py
class _NcclInvalid(Exception):
    """Like nccl4py's own argument check: no ``status``."""


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (NcclError(foreign.SYSTEM_ERROR, "unhandled system error"), Kind.PEER),
        (
            NcclError(foreign.REMOTE_ERROR, "remote process exited or there was a network error"),
            Kind.PEER,
        ),
        (NcclError(foreign.TIMEOUT, "timeout"), Kind.TIMEOUT),
        (NcclError(3, "internal error - please report this issue to the NCCL developers"), None),
        (
            NcclError(5, "invalid usage: connection closed by peer"),
            None,
        ),  # NCCL's text is never read
        (_NcclInvalid("bad argument"), None),
        (TimeoutError(), Kind.TIMEOUT),
    ],
)
def test_nccl_errors_are_read_by_their_result_code(exc: BaseException, kind: Kind | None) -> None:
    assert nccl_kind(exc) is kind
    assert foreign.status_of(exc) == getattr(exc, "status", None)


def test_a_failed_nccl_op_becomes_a_comm_aborted_with_its_cause() -> None:
    lost = NcclError(foreign.REMOTE_ERROR, "remote error")
    err = op_error(lost, nccl_kind(lost), backend="NCCL", seq=4, op="broadcast")
    assert type(err) is ac.PeerFailure and err.__cause__ is lost
    broken = NcclError(3, "internal error")
    err = op_error(
        broken, nccl_kind(broken), backend="NCCL", seq=4, op="broadcast", message="said so"
    )
    assert type(err) is ac.CommAborted and str(err) == "said so" and err.__cause__ is broken


# ------------------------------------------------------------------- one place
def _reads_message_text(tree: ast.AST) -> list[int]:
    """Lines that match on an exception's text: ``str(x).lower()``, ``... in str(x)``."""
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("lower", "casefold", "startswith", "endswith", "find")
            and isinstance(node.func.value, ast.Call)
            and ast.unparse(node.func.value.func) == "str"
        ):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(
            isinstance(op, (ast.In, ast.NotIn)) for op in node.ops
        ):
            if any(
                isinstance(c, ast.Call) and ast.unparse(c.func) == "str" for c in node.comparators
            ):
                lines.append(node.lineno)
    return lines


def test_only_the_boundary_reads_message_text() -> None:
    assert _reads_message_text(ast.parse('if "closed" in str(exc) or str(e).lower(): pass')) == [
        1,
        1,
    ]
    found = {}
    for path in sorted((ROOT / "asynccoll").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "asynccoll/_base/foreign.py":
            continue
        lines = _reads_message_text(ast.parse(path.read_text(), rel))
        if lines:
            found[rel] = lines
    assert not found, f"message text matched outside _base/foreign.py: {found}"
    assert _reads_message_text(ast.parse((ROOT / "asynccoll/_base/foreign.py").read_text()))
