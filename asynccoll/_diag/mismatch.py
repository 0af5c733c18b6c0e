"""Fingerprints of operations, and the ``CollectiveMismatch`` that differing ones produce.

A fingerprint is a short string: the fields ``FIELDS`` of one op joined by ``\x1f``
(a coalesced batch: its collective members joined by ``\x1e``). Ranks compare them
as strings; only a difference is decoded, to name the fields and ranks that differ.
"""

from __future__ import annotations

from typing import Any

from .._base.errors import CollectiveMismatch
from .._base.ops import OpKind, OpSpec

FIELDS = ("op", "dtype", "shape", "root", "reduce_op")
SEP, MEMBERS = "\x1f", "\x1e"
_SEP, _MEM = SEP, MEMBERS
P2P = (OpKind.SEND, OpKind.RECV)
_P2P = P2P  # point-to-point ops: compared by dtype and element count only
_DTYPES: dict[Any, str] = {}


def _dt(t: Any) -> str:
    name = _DTYPES.get(t.dtype)
    if name is None:
        name = _DTYPES[t.dtype] = str(t.dtype).replace("torch.", "")
    return name


def fingerprint(spec: OpSpec) -> str:
    """The compared description of one tensor op (fields: ``FIELDS``, joined)."""
    kind = spec.kind
    t = spec.tensor
    if kind is OpKind.ALL_REDUCE:
        return f"all_reduce{_SEP}{_dt(t)}{_SEP}{tuple(t.shape)}{_SEP}{_SEP}{spec.reduce_op.name}"
    if kind in _P2P:
        return f"p2p{_SEP}{_dt(t)}{_SEP}{t.numel()} elements{_SEP}{_SEP}"
    if kind is OpKind.BARRIER:
        return f"barrier{_SEP}{_SEP}{_SEP}{_SEP}"
    if kind in (OpKind.REDUCE_SCATTER, OpKind.SCATTER):
        t = spec.output  # the part every rank has
    root = (
        spec.peer
        if kind in (OpKind.BROADCAST, OpKind.REDUCE, OpKind.GATHER, OpKind.SCATTER)
        else ""
    )
    reduce = spec.reduce_op.name if kind in (OpKind.REDUCE, OpKind.REDUCE_SCATTER) else ""
    return f"{kind.value}{_SEP}{_dt(t)}{_SEP}{tuple(t.shape)}{_SEP}{root}{_SEP}{reduce}"


def object_fingerprint(op: str, root: int) -> str:
    return f"{op}{_SEP}{_SEP}{_SEP}{'' if root < 0 else root}{_SEP}"


def decode(fp: str) -> list[dict[str, str]]:
    """A fingerprint back into field dicts, one per member (one unless a batch)."""
    return [dict(zip(FIELDS, m.split(_SEP))) for m in fp.split(_MEM)]


# ---------------------------------------------------------------- mismatch text
def _clean(member: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in member.items() if v}


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def _by_value(values: dict[int, str]) -> str:
    groups: dict[str, list[int]] = {}
    for r in sorted(values):
        groups.setdefault(values[r], []).append(r)
    return ", ".join(f"{v or '-'} on {_ranks(rs)}" for v, rs in groups.items())


def _diff(members: dict[int, dict[str, str]]) -> tuple[list[str], list[str]]:
    parts, fields = [], []
    for field in FIELDS:
        values = {r: m.get(field, "") for r, m in members.items()}
        if len(set(values.values())) > 1:
            fields.append(field)
            parts.append(f"{field} {_by_value(values)}")
            if field == "op":
                break  # different ops: their other fields say nothing more
    return parts, fields


def mismatch(
    seqs: dict[int, int], fps: dict[int, str], *, me: int, what: str | None = None
) -> CollectiveMismatch:
    """The error for one unit whose fingerprints differ (``seqs``/``fps`` by rank)."""
    decoded = {r: decode(fp) for r, fp in fps.items()}
    seq = seqs[me]
    # Named after the lowest rank's op, not this rank's: every rank writes the same
    # text (a rank may learn the mismatch from a peer's abort news instead).
    mine = decoded[min(decoded)]
    name = what or (mine[0]["op"] if len(mine) == 1 else f"coalesced batch of {len(mine)}")
    counts = {r: len(d) for r, d in decoded.items()}
    fields: list[str] = []
    if len(set(counts.values())) > 1:
        parts = ["members " + _by_value({r: str(n) for r, n in counts.items()})]
        fields = ["members"]
    else:
        parts = []
        for i in range(len(mine)):
            sub, f = _diff({r: d[i] for r, d in decoded.items()})
            if sub and len(mine) > 1:
                sub = [f"member {i} ({mine[i]['op']}): " + "; ".join(sub)]
            parts += sub
            fields += [x for x in f if x not in fields]
    if len(set(seqs.values())) > 1:
        parts.append("(seq " + _by_value({r: str(s) for r, s in seqs.items()}) + ")")
    message = f"seq {seq} {name}: " + "; ".join(parts)
    details = {
        r: {
            "seq": seqs[r],
            **(
                _clean(d[0])
                if len(d) == 1
                else {"op": "coalesced", "members": [_clean(m) for m in d]}
            ),
        }
        for r, d in sorted(decoded.items())
    }
    return CollectiveMismatch(message, seq=seq, details=details, fields=tuple(fields))


def for_rank(peer: CollectiveMismatch, rank: int) -> CollectiveMismatch:
    """A peer's verdict (from its abort news) as ``rank`` states it: ``rank``'s own seq;
    the rest of the text, the fields and the details are the same on every rank
    (:func:`mismatch` writes ``seq <seq> <the same text>``)."""
    seq = peer.details[rank]["seq"]
    text, head = str(peer), f"seq {peer.seq} "
    body = text[len(head) :] if text.startswith(head) else text
    return CollectiveMismatch(
        f"seq {seq} {body}", seq=seq, details=peer.details, fields=peer.fields
    )
