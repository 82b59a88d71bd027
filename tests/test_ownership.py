"""Which rank owns each subgroup: balanced by size, stable under add_param_group.

layout.assign_owners decides it for MLPOffloadOptimizer in a process group;
checkpoints record it (layout.owners), and readers find each subgroup's
record from it. The multi-rank behaviour (steps, saves, resharding, old
saves without owners) is in test_distributed*.py.
"""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from mlp_offload import errors, layout


def subgroups(*groups):
    """Subgroup records of the given sizes, one list per param group."""
    out = []
    for gi, sizes in enumerate(groups):
        for n in sizes:
            out.append(layout.Subgroup(len(out), gi, [], [], [], n))
    return out


def loads(sgs, owners, world):
    per = [0] * world
    for sg, rank in zip(sgs, owners):
        per[rank] += sg.numel
    return per


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [1, 4, 7, 12])
def test_subgroups_of_one_size_go_round_robin(world, count):
    sgs = subgroups([1000] * count)
    assert layout.assign_owners(sgs, world) == layout.round_robin_owners(count, world)


def test_a_large_first_subgroup_is_balanced_by_the_rest():
    # GPT-2's shape: the embedding first, then many smaller subgroups.
    # Round-robin gives rank 0 the embedding and half the rest.
    sgs = subgroups([38_600_000] + [7_000_000] * 12)
    owners = layout.assign_owners(sgs, 2)
    # Rank 1 takes six until it holds more than the embedding, then they
    # take turns.
    assert owners == [0] + [1] * 6 + [0, 1] * 3
    assert loads(sgs, owners, 2) == [38_600_000 + 3 * 7_000_000, 9 * 7_000_000]
    rr = loads(sgs, layout.round_robin_owners(len(sgs), 2), 2)
    assert max(loads(sgs, owners, 2)) < max(rr)


@pytest.mark.parametrize("seed", range(20))
def test_the_busiest_rank_is_within_the_greedy_bounds(seed):
    """Each subgroup goes to the least loaded rank, so the busiest rank's
    last one started at most at the mean: no rank holds more than the mean
    plus the largest subgroup. Within one param group, largest first, it is
    also within 4/3 of the best possible (at least the mean and the
    largest)."""
    rng = random.Random(seed)
    world = rng.randint(2, 8)
    groups = [[rng.choice([1, 10, 100, 1000]) * rng.randint(1, 50)
               for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 3))]
    sgs = subgroups(*groups)
    per = loads(sgs, layout.assign_owners(sgs, world), world)
    mean, largest = sum(map(sum, groups)) / world, max(map(max, groups))
    assert max(per) <= mean + largest, (per, groups, world)
    one = subgroups(sum(groups, []))
    per = loads(one, layout.assign_owners(one, world), world)
    assert max(per) <= 4 / 3 * max(mean, largest), (per, groups, world)


def test_owners_of_a_group_do_not_depend_on_the_groups_after_it():
    first = [5000, 300, 4000, 4000, 200]
    second = [9000, 100, 2500]
    alone = layout.assign_owners(subgroups(first), 3)
    together = layout.assign_owners(subgroups(first, second), 3)
    assert together[:len(first)] == alone
    # The second group starts from the loads the first left: its largest
    # subgroup goes to the least loaded rank.
    per = loads(subgroups(first), alone, 3)
    assert together[len(first)] == per.index(min(per))


def test_ranks_beyond_the_subgroups_own_none():
    sgs = subgroups([10, 300, 20])
    owners = layout.assign_owners(sgs, 5)
    assert sorted(owners) == [0, 1, 2]
    assert owners[1] == 0  # the largest to rank 0


def test_real_packing_of_a_model():
    """The owners of what layout.pack makes of a model's param groups."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    groups = [{"params": [model[0].weight, model[1].weight]},
              {"params": [model[0].bias, model[1].bias]}]
    sgs = layout.pack(groups, 200)
    assert [sg.numel for sg in sgs] == [512, 256, 40]
    assert layout.assign_owners(sgs, 2) == [0, 1, 1]


def test_record_indices_count_each_owners_subgroups_in_order():
    assert layout.record_indices([0, 1, 1, 0, 2, 1]) == [0, 0, 1, 1, 0, 2]
    assert layout.record_indices(layout.round_robin_owners(7, 3)) == \
        [g // 3 for g in range(7)]
    assert layout.record_indices([]) == []


@pytest.mark.parametrize("world", [0, -1, 1.5, None])
def test_a_bad_world_size_is_named(world):
    with pytest.raises(errors.ConfigError, match="world size must be a positive int"):
        layout.assign_owners(subgroups([1]), world)


def test_ownership_bench_compares_the_two_assignments(request, tmp_path):
    """tools/ownership_bench.py on a tiny model: two ranks, both owner
    assignments, every parameter owned once; balanced by size, the busiest
    rank holds less than round-robin gives it."""
    script = request.config.getoption("--ownership_bench")
    if not script:
        pytest.skip("run through bazel: needs --ownership_bench")
    out = subprocess.run(
        [sys.executable, script, "--dir", str(tmp_path), "--ranks", "2", "--rounds", "1",
         "--steps", "1", "--vocab", "2000", "--dim", "64", "--layers", "3", "--seq", "32",
         "--subgroup_numel", "2e4", "--cap", "0", "--json"],
        check=True, capture_output=True, text=True, timeout=300).stdout
    result = json.loads(out)
    # The embedding (2000 x 64) and 7 subgroups of up to 2e4 elements.
    assert result["subgroups"][0] == 2000 * 64 and len(result["subgroups"]) > 4
    for name in ("balanced", "round_robin"):
        assert sum(result[name]["params"]) == result["params"], name
        assert result[name]["step_seconds"] > 0
    assert max(result["balanced"]["params"]) < max(result["round_robin"]["params"])
    assert os.listdir(tmp_path) == []  # its directories are removed


def test_frozen_subgroups_are_balanced_apart_from_the_trainable_ones():
    """A frozen embedding (not updated) does not leave its rank without
    trainable subgroups: each kind is spread on its own."""
    sgs = subgroups([100_000] + [10_000] * 8)
    sgs[0].trainable = False
    owners = layout.assign_owners(sgs, 2)
    trainable = [0, 0]
    for sg, rank in zip(sgs, owners):
        if sg.trainable:
            trainable[rank] += sg.numel
    assert trainable == [40_000, 40_000]
    assert owners[0] == 0
    # What layout.pack records, whatever requires_grad says later.
    torch.manual_seed(0)
    frozen, live = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    frozen.requires_grad_(False)
    packed = layout.pack([{"params": [*frozen.parameters(), *live.parameters()]}], 1000)
    assert [sg.trainable for sg in packed] == [False, True]
    frozen.requires_grad_(True)
    assert [sg.trainable for sg in layout.pack(
        [{"params": [*frozen.parameters(), *live.parameters()]}], 1000,
        trainable={id(p): False for p in frozen.parameters()})] == [False, True]
