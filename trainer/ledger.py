"""The run's ledger: every accepted group, every batch trained, every group dropped, on disk as it happens.

Three append-only JSON-lines files under the run directory:
  accepted.jsonl  each accepted group in full (prompt, samples, recomputed rewards, version, node), written
                  before the node is told "accepted", so a trainer crash cannot lose accepted data;
  batches.jsonl   per optimizer step, the assignment ids it trained on, in order;
  dropped.jsonl   groups that will never be trained, with the reason and the step they were dropped at.
On resume from the checkpoint of step s, lines of later steps are cut (that work is redone), and the
accepted groups that are neither in a kept batch nor dropped go back to the learner's buffer. The same
files let anyone check the accounting and replay the run's updates (trainer/replay.py).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from swarm_common.atomic import write_atomic
from trainer.intake import Group


class BatchLine(msgspec.Struct):
    step: int
    groups: list[list]  # [node_id, assignment_id, item_id, version]


class DropLine(msgspec.Struct):
    assignment_id: str
    reason: str
    step: int


class Ledger:
    def __init__(self, run_dir: str | Path, write: bool = True):
        root = Path(run_dir)
        self.accepted_path = root / "accepted.jsonl"
        self.batches_path = root / "batches.jsonl"
        self.dropped_path = root / "dropped.jsonl"
        self._enc = msgspec.json.Encoder()
        if write:
            self._open()

    def _open(self) -> None:
        self._accepted = open(self.accepted_path, "ab")
        self._batches = open(self.batches_path, "ab")
        self._dropped = open(self.dropped_path, "ab")

    def close(self) -> None:
        for f in (self._accepted, self._batches, self._dropped):
            f.close()

    def _write(self, f, obj) -> None:
        # flush: the line is in the OS's hands before we go on, so it survives a SIGKILL of this process.
        f.write(self._enc.encode(obj) + b"\n")
        f.flush()

    def accepted(self, g: Group) -> None:
        self._write(self._accepted, g)

    def batch(self, step: int, groups: list[Group]) -> None:
        self._write(self._batches, BatchLine(step, [[g.node_id, g.assignment_id, g.item.id, g.version] for g in groups]))

    def dropped(self, groups: list[Group], reason: str, step: int) -> None:
        for g in groups:
            self._write(self._dropped, DropLine(g.assignment_id, reason, step))

    # ---- reading back ---------------------------------------------------------------------------

    @staticmethod
    def _lines(path: Path, typ):
        if not path.exists():
            return []
        out = []
        dec = msgspec.json.Decoder(typ)
        for raw in path.read_bytes().splitlines():
            try:
                out.append(dec.decode(raw))
            except msgspec.DecodeError:
                break  # a line cut short by a crash ends the file
        return out

    def read_accepted(self) -> list[Group]:
        return self._lines(self.accepted_path, Group)

    def read_batches(self) -> list[BatchLine]:
        return self._lines(self.batches_path, BatchLine)

    def read_dropped(self) -> list[DropLine]:
        return self._lines(self.dropped_path, DropLine)

    def truncate_after(self, step: int) -> None:
        """Forget batches and drops of steps after `step` (their work is redone), and torn last lines."""
        self.close()
        keep_batches = [b for b in self.read_batches() if b.step <= step]
        keep_dropped = [d for d in self.read_dropped() if d.step <= step]
        accepted = self.read_accepted()
        for path, rows in ((self.batches_path, keep_batches), (self.dropped_path, keep_dropped),
                           (self.accepted_path, accepted)):
            write_atomic(path, b"".join(self._enc.encode(r) + b"\n" for r in rows))
        self._open()

    def pending(self) -> list[Group]:
        """Accepted groups that no kept batch trained on and that were not dropped, oldest first."""
        done = {aid for b in self.read_batches() for _, aid, _, _ in b.groups}
        done |= {d.assignment_id for d in self.read_dropped()}
        return [g for g in self.read_accepted() if g.assignment_id not in done]


def accounting(run_dir: str | Path) -> dict:
    """Every accepted group trained on exactly once or dropped with a reason: the figures and any breach."""
    led = Ledger(run_dir, write=False)
    accepted = [g.assignment_id for g in led.read_accepted()]
    trained = [aid for b in led.read_batches() for _, aid, _, _ in b.groups]
    dropped = led.read_dropped()
    reasons: dict[str, int] = {}
    for d in dropped:
        reasons[d.reason] = reasons.get(d.reason, 0) + 1
    seen: dict[str, int] = {}
    for aid in trained + [d.assignment_id for d in dropped]:
        seen[aid] = seen.get(aid, 0) + 1
    acc = set(accepted)
    return {
        "accepted": len(accepted),
        "trained": len(trained),
        "dropped": reasons,
        "duplicate_accepts": len(accepted) - len(acc),
        "twice": sorted(a for a, n in seen.items() if n > 1),
        "unaccounted": sorted(acc - set(seen)),
        "unknown": sorted(set(seen) - acc),
    }
