"""The launcher's trainer group (launcher.processes.TrainerRanks, started by Stack for `ranks` > 1): every rank gets
the torchrun-style environment of one group; a respawn starts a fresh group on a fresh port."""

from __future__ import annotations

import os
import sys

import yaml

from launcher.processes import TrainerRanks

PRINT_ENV = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'], " \
            "os.environ['MASTER_PORT'], os.environ['LOCAL_RANK'])"


def logged(tmp_path) -> list[list[str]]:
    names = ["trainer.log", "trainer-rank1.log", "trainer-rank2.log"]
    return [(tmp_path / name).read_text().split("\n")[-2].split() for name in names]


def test_each_rank_gets_one_groups_environment_and_a_respawn_a_fresh_port(tmp_path):
    ranks = TrainerRanks([sys.executable, "-c", PRINT_ENV], 3, tmp_path, cwd=tmp_path, env=dict(os.environ))
    ranks.spawn().wait(timeout=60)
    ranks.stop(grace=60)
    first = logged(tmp_path)
    assert [row[0] for row in first] == ["0", "1", "2"] and [row[4] for row in first] == ["0", "1", "2"]
    assert {tuple(row[1:4]) for row in first} == {("3", "127.0.0.1", first[0][3])}
    ranks.spawn().wait(timeout=60)
    ranks.stop(grace=60)
    assert ranks.followers == []
    assert len({row[3] for row in logged(tmp_path)}) == 1  # the second group shares its own port


def test_the_stack_starts_a_trainer_of_several_ranks_as_a_group(tmp_path):
    from launcher.stack import Stack, random_ports

    stack = Stack(tmp_path / "run", random_ports(), secure=False)
    config = tmp_path / "trainer.yaml"
    config.write_text(yaml.safe_dump({"backend": "fsdp2", "ranks": 2}))
    (tmp_path / "run" / "logs").mkdir(parents=True, exist_ok=True)
    spawn = stack._spawner("trainer", config, detach=False)
    assert stack.trainer_ranks is not None and spawn == stack.trainer_ranks.spawn and stack.trainer_ranks.ranks == 2
    config.write_text(yaml.safe_dump({"backend": "torch"}))
    stack.trainer_ranks = None
    stack._spawner("trainer", config, detach=False)
    assert stack.trainer_ranks is None
