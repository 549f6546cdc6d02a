"""One group leader of :mod:`tests.test_group_link`: ``SUMS`` sums of ``[group + 1, 1]`` over the link (a
value and a count), one JSON line per sum to ``OUT`` (the sum, the quorum's groups, the sums committed, the
time), then a last line ``{"end": ...}``. A leader whose group comes back (the run under way: the test
restarted it) first writes ``{"healed": state, "at": n}``: the state its source handed over, and the sum it
joined at; after every sum that admitted a group back, the source hands over ``{"from": group, "at": n}``.
``KILL_AFTER`` (≥ 0): SIGKILL itself after that many sums; ``SLOW_AFTER`` (≥ 0): sleep ``SLOW_S`` once
after that many (its heartbeat goes on). A :class:`GroupLost` ends it with status 3 and its message on
stderr.

    python tests/group_link_job.py HOST PORT GROUP GROUPS SUMS OUT KILL_AFTER SLOW_AFTER SLOW_S
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import torch

from mpicrossbow.comm.group_link import GroupLink, GroupLost


def main(argv: list[str]) -> int:
    host, port, group, groups, sums, out, kill_after, slow_after, slow_s = argv
    group, sums, kill_after, slow_after = int(group), int(sums), int(kill_after), int(slow_after)
    logging.basicConfig(level=logging.INFO, format=f"[group {group}] %(levelname)s %(message)s")
    with open(out, "w") as lines:
        try:
            link = GroupLink(host, int(port), group, int(groups), dead_after_s=1.5, join_s=10.0, admit=True)
            if group in link.quorum.joined:  # back: the state first, from a peer
                healed = json.loads(link.share_state(None))
                lines.write(json.dumps({"healed": healed, "at": link.committed}) + "\n")
            for n in range(link.committed, sums):
                if n == kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                if n == slow_after:
                    time.sleep(float(slow_s))
                tensor = torch.tensor([group + 1.0, 1.0])
                quorum = link.allreduce(tensor)
                if link.pending:  # this job's state is whole after every sum: admit them at once
                    quorum = link.admit_pending()
                if quorum.joined:
                    state = {"from": group, "at": link.committed}
                    link.share_state(json.dumps(state).encode() if group == quorum.source else None)
                row = {"sum": tensor.tolist(), "groups": list(quorum.groups), "n": link.committed,
                       "t": time.monotonic()}  # fmt: skip
                lines.write(json.dumps(row) + "\n")
                lines.flush()
                time.sleep(0.02)  # a step's compute
            link.close()
        except GroupLost as exc:
            print(exc, file=sys.stderr)
            return 3
        lines.write(json.dumps({"end": link.committed}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
