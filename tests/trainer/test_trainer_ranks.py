"""A trainer rank group's command channel (backends.leader): followers take rank 0's collective calls in order;
a rank that dies ends the group with an error within the timeout instead of a hang."""

from __future__ import annotations

import datetime
import os
import time

from tests.ranks import run_spawned

TIMEOUT, DEADLINE = 30.0, 180.0  # generous: the machine may be loaded


class Recorder:
    """A stand-in backend: records the collective calls it takes."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.rank, self.world, self.calls = dist.get_rank(), dist.get_world_size(), []

    def step(self, batch, version):
        self.calls.append(("step", batch, version))
        return {"version": float(version)}

    def state(self):
        self.calls.append(("state",))
        return {}

    def close(self):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def rank_main(rank: int, store: str, scenario: str, out: str) -> None:
    import torch.distributed as dist

    from services.trainer.backends.leader import Leader, follow

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT))
    backend = Recorder()
    if rank == 0:
        leader = Leader(backend, TIMEOUT)
        assert leader.step([1, 2], 0) == {"version": 0.0} and leader.state() == {}
        leader.last_sent = 0.0
        leader.heartbeat()
        assert leader.step([3], 1) == {"version": 1.0}
        if scenario == "leader_dies":
            os._exit(0)
        if scenario == "follower_dies":
            time.sleep(2.0)  # rank 1 is gone by now
            try:
                for _ in range(10):
                    leader.last_sent = 0.0
                    leader.heartbeat()
                    time.sleep(0.5)
            except RuntimeError as exc:
                with open(out, "w") as f:
                    f.write(str(exc))
                os._exit(0)
            os._exit(3)
        leader.stop()
        with open(out, "w") as f:
            f.write(repr(backend.calls))
        return
    if scenario == "follower_dies":
        follow_until(4)  # step, state, ping, step: then die
        os._exit(0)
    try:
        follow(backend, TIMEOUT)
    except RuntimeError as exc:
        with open(out, "w") as f:
            f.write(str(exc))
        return
    with open(out, "w") as f:
        f.write(repr(backend.calls))


def follow_until(commands: int) -> None:
    """Take `commands` commands off the channel follow() reads, then return (and the rank dies)."""
    import torch.distributed as dist

    from services.trainer.backends.leader import control_group

    group = control_group(TIMEOUT)
    for _ in range(commands):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        if box[0][0] == "step":
            dist.barrier(group=group)


def run_group(tmp_path, scenario: str) -> list[str]:
    outs = [str(tmp_path / f"out{r}") for r in range(2)]
    codes = run_spawned(rank_main, [(r, str(tmp_path / "store"), scenario, outs[r]) for r in range(2)],
                        deadline_s=DEADLINE)
    assert all(c is not None and c >= 0 for c in codes), f"exit codes {codes} (killed at the deadline: a hang)"
    return [open(o).read() if os.path.exists(o) else "" for o in outs]


def test_followers_take_rank_0s_collective_calls_in_order_and_stop_with_it(tmp_path):
    leader_out, follower_out = run_group(tmp_path, "clean")
    assert follower_out == leader_out == repr([("step", [1, 2], 0), ("state",), ("step", [3], 1)])


def test_a_dead_rank_0_ends_the_follower_with_an_error(tmp_path):
    _, follower_out = run_group(tmp_path, "leader_dies")
    assert follower_out.startswith("trainer rank 1: rank 0 is gone")


def test_a_dead_follower_fails_rank_0s_next_command(tmp_path):
    leader_out, _ = run_group(tmp_path, "follower_dies")
    assert leader_out.startswith("trainer ranks: a rank of 2 is gone")
