"""Bad constructor input is a ConfigError naming the argument and the value.

Tier dict values, tier_bandwidths, host_cache_bytes, the bool and path
arguments and $LOCAL_WORLD_SIZE: each bad value is refused before anything
is written, never accepted silently (a NaN bandwidth, "false" read as true)
and never an untyped error from os.fspath, float() or the bindings. Also:
a second optimizer of this process on a live run is named as such.
"""

import os
import re
import time

import pytest
import torch
from conftest import tier_dirs

from mlp_offload import MLPOffloadOptimizer, config, errors

torch.set_num_threads(1)  # CI shares 2 cores between test processes


def make_model():
    torch.manual_seed(0)
    return torch.nn.Linear(16, 8)


def wrap(model, tiers, **kwargs):
    kwargs.setdefault("subgroup_numel", 100)
    kwargs.setdefault("compute_threads", 1)
    return MLPOffloadOptimizer(torch.optim.AdamW(model.parameters()), tiers=tiers, **kwargs)


def refused(tiers, match, **kwargs):
    with pytest.raises(errors.ConfigError, match=match):
        wrap(make_model(), tiers, **kwargs).close()


@pytest.mark.parametrize("key,value", [
    ("read_bytes_per_sec", "fast"), ("read_bytes_per_sec", float("nan")),
    ("write_bytes_per_sec", float("inf")), ("read_bytes_per_sec", 0),
    ("write_bytes_per_sec", -1e9), ("read_bytes_per_sec", True),
    ("throttle_read_bytes_per_sec", -1), ("throttle_write_bytes_per_sec", float("nan")),
    ("throttle_contention", float("nan")), ("throttle_contention", -3),
    ("shared_by", 0), ("shared_by", -1), ("shared_by", 2.0),
    ("capacity_bytes", 2 ** 64), ("throttle_shared", "yes"), ("path", 3),
    ("throttle_half_duplex", 1),
])
def test_bad_tier_value_is_a_config_error_naming_it(tmp_path, key, value):
    a, b = tier_dirs(tmp_path)
    tier = {"path": a, key: value}
    refused([tier, b], rf"tier 0: '{key}' must .*got {re.escape(repr(value))}$")
    assert os.listdir(a) == [] and os.listdir(b) == []


@pytest.mark.parametrize("bandwidths,match", [
    (["1GB", "2GB"], r"tier_bandwidths\[0\] must be .*got '1GB'"),
    ([float("nan"), 1e9], r"tier_bandwidths\[0\] must be a finite number > 0.*got nan"),
    ([1e9, (1e9, float("inf"))], r"tier_bandwidths\[1\] \(write\) must .*got inf"),
    ([1e9, (1e9, 2e9, 3e9)], r"tier_bandwidths\[1\] must be .*pair, got \(1"),
    ("1GB", r"tier_bandwidths must be a list .*got '1GB'"),
    (5, r"tier_bandwidths must be a list .*got 5"),
])
def test_bad_tier_bandwidths_are_config_errors(tmp_path, bandwidths, match):
    refused(tier_dirs(tmp_path), match, tier_bandwidths=bandwidths)


def test_good_tier_values_are_kept():
    # What the checks let through reaches the engine as before: unknown
    # (None or left out) bandwidths take the default, 0 caps mean none.
    tiers = config.normalize_tiers(
        [{"path": "/a", "read_bytes_per_sec": None, "write_bytes_per_sec": 3,
          "throttle_read_bytes_per_sec": 0, "throttle_contention": 0.5, "shared_by": 2,
          "capacity_bytes": 1 << 40},
         "/b", "/c"],
        tier_bandwidths=[None, (1e9, 2e9), 4e9], shared_by=3)
    assert tiers[0]["read_bytes_per_sec"] == config.DEFAULT_TIER_BYTES_PER_SEC
    assert tiers[0]["write_bytes_per_sec"] == 3.0 and tiers[0]["shared_by"] == 2
    assert tiers[0]["throttle_read_bytes_per_sec"] == 0.0
    assert tiers[1]["read_bytes_per_sec"] == 1e9 and tiers[1]["write_bytes_per_sec"] == 2e9
    assert tiers[2]["read_bytes_per_sec"] == tiers[2]["write_bytes_per_sec"] == 4e9
    assert tiers[1]["shared_by"] == 3
    with pytest.raises(errors.ConfigError, match=r"shared_by must be an int .*got 0"):
        config.normalize_tiers(["/a"], shared_by=0)


def test_host_cache_bytes_beyond_the_engine_is_a_config_error(tmp_path):
    refused(tier_dirs(tmp_path), rf"host_cache_bytes must be an int .*got {2 ** 64}",
            host_cache_bytes=2 ** 64)


@pytest.mark.parametrize("name,value", [
    ("verify_checksums", "no"), ("atomic_step", "false"), ("verify_checksums", None),
    ("checkpoint_dir", 5), ("checkpoint_dir", b"/tmp"), ("checkpoint_dir", ""),
    ("tier_lock_dir", 5), ("subgroup_numel", True), ("subgroup_numel", 0),
    ("generic_state_keys", "square_avg"), ("generic_state_keys", ["a", 1]),
    # Also where the run does not persist (before: a TypeError from deep
    # inside, the private name quoted, or "" taken as the default).
    ("run_name", 123), ("run_name", ["x"]), ("run_name", "../up"), ("run_name", ""),
])
def test_bool_and_path_arguments_are_checked(tmp_path, name, value):
    match = rf"{name} is an empty path" if value == "" and name != "run_name" \
        else rf"{name} must be .*got {re.escape(repr(value))}$"
    refused(tier_dirs(tmp_path), match, **{name: value})


@pytest.mark.parametrize("text", ["abc", "0", "-3", "2.5"])
def test_bad_local_world_size_is_a_config_error_naming_it(tmp_path, monkeypatch, text):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", text)
    refused(tier_dirs(tmp_path), rf"environment variable LOCAL_WORLD_SIZE .*got '{text}'")


def test_validators(monkeypatch):
    assert config.check_bool("x", False) is False
    assert config.check_path("x", os.path.join("a", "b")) == "a/b"
    assert config.check_int("x", 7, minimum=1) == 7
    assert config.check_number("x", 0) == 0.0
    for check, value in [(config.check_bool, 1), (config.check_bool, "true"),
                         (config.check_path, None), (config.check_int, 1.0),
                         (config.check_int, -1), (config.check_int, False),
                         (config.check_number, "1"), (config.check_number, -0.5),
                         (config.check_number, float("inf")), (config.check_rate, 0)]:
        with pytest.raises(errors.ConfigError, match=rf"^the_arg .*{re.escape(repr(value))}"):
            check("the_arg", value)
    monkeypatch.delenv("MLP_TEST_COUNT", raising=False)
    assert config.env_int("MLP_TEST_COUNT", 4, minimum=1) == 4
    monkeypatch.setenv("MLP_TEST_COUNT", " 2 ")
    assert config.env_int("MLP_TEST_COUNT", 4, minimum=1) == 2
    monkeypatch.setenv("MLP_TEST_COUNT", "0")
    with pytest.raises(errors.ConfigError, match="MLP_TEST_COUNT must be an integer >= 1"):
        config.env_int("MLP_TEST_COUNT", 4, minimum=1)


def test_second_optimizer_of_this_process_on_a_live_run_is_named(tmp_path):
    tiers = tier_dirs(tmp_path, 1)
    first = wrap(make_model(), tiers, run_name="busy", commit_every=1)
    try:
        with pytest.raises(errors.TierInUseError,
                           match=rf"another optimizer in this process \(pid {os.getpid()}\)"):
            wrap(make_model(), tiers, run_name="busy", commit_every=1)
    finally:
        first.close()


def test_a_thread_the_system_refuses_is_a_system_resource_error(tmp_path):
    """A thread limit (a container's pids.max) met while the engine starts
    its threads: SystemResourceError naming the thread, not a TierFullError
    or a C++ exception, and nothing left running: the same tiers then take
    an optimizer that trains."""
    from mlp_offload import _C
    tiers = tier_dirs(tmp_path, 2)
    refused = []
    for nth in range(1, 30):
        model = torch.nn.Linear(16, 8)
        _C._fail_nth_thread_start_for_testing(nth)
        try:
            opt = wrap(model, tiers, compute_threads=2)
        except errors.SystemResourceError as e:
            refused.append(str(e))
            continue
        finally:
            _C._fail_nth_thread_start_for_testing(0)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.close()
    assert len(refused) >= 5, refused  # compute, then each tier's threads
    assert all(re.match(r"could not start a thread \(.+\): Resource temporarily "
                        r"unavailable \(the system's limit on threads", m) for m in refused)
    assert not issubclass(errors.SystemResourceError, errors.TierError)


def test_a_thread_refused_to_a_kernel_call_is_a_system_resource_error():
    """A kernel call whose thread pool cannot start raises SystemResourceError
    (the error used to be raised without the GIL: the interpreter crashed)."""
    from mlp_offload import _C
    x = torch.randn(1000)
    y = torch.empty(1000, dtype=torch.bfloat16)
    for threads in (5, 6):  # pools not made yet in this thread
        _C._fail_nth_thread_start_for_testing(1)
        try:
            with pytest.raises(errors.SystemResourceError, match="could not start a thread"):
                if threads == 5:
                    _C.kernels.convert_from_float32(x.data_ptr(), y.data_ptr(), "bfloat16",
                                                    1000, num_threads=threads)
                else:
                    _C.kernels.convert_to_float32(y.data_ptr(), "bfloat16", x.data_ptr(),
                                                  1000, num_threads=threads)
        finally:
            _C._fail_nth_thread_start_for_testing(0)
    _C.kernels.convert_from_float32(x.data_ptr(), y.data_ptr(), "bfloat16", 1000,
                                    num_threads=5)
    assert torch.equal(y, x.to(torch.bfloat16))


def test_the_engine_is_used_by_one_thread_at_a_time(tmp_path):
    """While a step runs in one thread (without the GIL), a call of the
    engine or close() from another raises ConcurrentUseError and changes
    nothing (close() used to free the engine under the step: a crash)."""
    import threading
    # About 1 s of capped I/O a step.
    tiers = [{"path": d, "throttle_read_bytes_per_sec": 1e5,
              "throttle_write_bytes_per_sec": 1e5} for d in tier_dirs(tmp_path, 1)]
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = wrap(model, tiers, subgroup_numel=2000)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()  # the initial state is written
    running = threading.Event()
    outcome = []

    def step():
        running.set()
        try:
            opt.step()
            outcome.append("done")
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome.append(e)

    worker = threading.Thread(target=step)
    worker.start()
    running.wait()
    engine = opt.engine
    deadline = time.monotonic() + 5
    while not engine.busy and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.busy, "the step never started"
    with pytest.raises(errors.ConcurrentUseError, match="another thread"):
        engine.steps
    with pytest.raises(errors.ConcurrentUseError, match="another thread"):
        opt.close()
    with pytest.raises(errors.ConcurrentUseError, match="another thread"):
        engine.close()
    worker.join()
    assert outcome == ["done"], outcome
    assert not engine.busy and engine.steps == 2
    opt.close()
    assert engine.closed


def test_engine_copy_calls_refuse_buffers_not_of_the_subgroups_size(tmp_path):
    """The engine's copy calls take bare addresses: a size that is not the
    subgroup's is a ConfigError naming both, before any byte is copied (a
    too-small buffer would have been overrun), and the state is unchanged."""
    model = make_model()  # the weight (128) and the bias (8), a subgroup each
    opt = wrap(model, tier_dirs(tmp_path, 1))
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    engine = opt._engine
    sizes = [128, 8]
    assert [sg.numel for sg in opt._subgroups] == sizes
    before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    small = torch.zeros(50)
    arrays = [torch.zeros(50), torch.zeros(50)]
    ptrs = [a.data_ptr() for a in arrays]
    with pytest.raises(errors.ConfigError,
                       match=r"read_subgroups: subgroup 0 has 128 elements, the buffers "
                             r"given hold 50"):
        engine.read_subgroups([(0, small.data_ptr(), ptrs, 50)])
    with pytest.raises(errors.ConfigError, match=r"write_subgroups: subgroup 1 has 8 "):
        engine.write_subgroups([(1, small.data_ptr(), ptrs, 3, 50)])
    with pytest.raises(errors.ConfigError, match=r"initialize_subgroups: subgroup 0 "):
        engine.initialize_subgroups([(0, small.data_ptr(), 50, None)], "float32")
    big = [torch.full((128,), 7.0) for _ in range(3)]
    whole = (0, big[0].data_ptr(), [b.data_ptr() for b in big[1:]])
    with pytest.raises(errors.ConfigError, match=r"read_subgroups: subgroup 1 has 8 "):
        engine.read_subgroups([whole + (128,), (1, small.data_ptr(), ptrs, 50)])
    with pytest.raises(errors.ConfigError, match=r"write_subgroups: subgroup 1 has 8 "):
        engine.write_subgroups([whole + (3, 128), (1, small.data_ptr(), ptrs, 3, 50)])
    with pytest.raises(errors.ConfigError, match=r"WriteSubgroups: subgroup 0 given twice"):
        engine.write_subgroups([whole + (3, 128), whole + (3, 128)])
    # The right sizes are taken; nothing above changed the state.
    master = torch.empty(8)
    state = [torch.empty(8), torch.empty(8)]
    assert engine.read_subgroups([(1, master.data_ptr(), [s.data_ptr() for s in state], 8)]) \
        == [1]
    assert torch.equal(master, model.bias.detach())
    after = opt.state_dict()["state"][0]
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    opt.close()


def test_parameters_of_two_dtypes_are_refused_naming_the_first_of_each(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(16, 8).to(torch.bfloat16),
                                torch.nn.LayerNorm(8))  # kept in fp32
    with pytest.raises(errors.ConfigError,
                       match=r"one dtype, got bfloat16 \(parameter 0 first\), float32 "
                             r"\(parameter 2 first\).*optimizer of their own"):
        wrap(model, tier_dirs(tmp_path, 1))


def test_a_half_duplex_throttle_needs_both_caps(tmp_path):
    # It says how the two caps share one device: with one cap or none it
    # did nothing, silently.
    a, b = tier_dirs(tmp_path)
    for caps in ({}, {"throttle_read_bytes_per_sec": 1e8}):
        refused([{"path": a, "throttle_half_duplex": True, **caps}, b],
                r"tier 0: 'throttle_half_duplex' says how the throttle's read and write caps "
                r"share one device: give both")
    tiers = config.normalize_tiers([{"path": a, "throttle_half_duplex": True,
                                     "throttle_read_bytes_per_sec": 1e8,
                                     "throttle_write_bytes_per_sec": 5e7}])
    assert tiers[0]["throttle_half_duplex"] is True


def test_a_checkpoint_dir_that_is_a_file_is_refused_at_construction(tmp_path):
    # Before, resume="auto" found no checkpoint in it and started afresh,
    # and only the first save said why.
    afile = tmp_path / "afile"
    afile.write_bytes(b"")
    refused(tier_dirs(tmp_path), rf"checkpoint_dir {re.escape(str(afile))} is not a directory",
            checkpoint_dir=afile, run_name="r", resume="auto")


@pytest.mark.parametrize("persistent", [False, True])
def test_a_checkpoint_inside_a_run_directory_is_refused(tmp_path, persistent):
    # A save into the optimizer's own (private) run directory succeeded, and
    # close() removed it with the run. Refused by name, nothing written;
    # beside the run directories, on the tier, is fine.
    tiers = tier_dirs(tmp_path)
    kwargs = dict(run_name="r", commit_every=1) if persistent else {}
    model = make_model()
    opt = wrap(model, tiers, **kwargs)
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    runs = [os.path.join(tiers[1], d) for d in os.listdir(tiers[1])]
    assert len(runs) == 1, runs
    inside = os.path.join(runs[0], "ckpt")
    with pytest.raises(errors.ConfigError,
                       match=rf"save_checkpoint: {re.escape(inside)} is inside "
                             rf"{re.escape(os.path.realpath(runs[0]))}, a run directory of "
                             rf"this optimizer on tier {re.escape(tiers[1])}"):
        opt.save_checkpoint(inside)
    assert not os.path.exists(inside)
    beside = os.path.join(tiers[1], "ckpt")
    opt.save_checkpoint(beside)
    opt.close()
    again = wrap(make_model(), tier_dirs(tmp_path, prefix="u"))
    again.load_checkpoint(beside)
    again.close()



def test_a_tier_too_small_for_its_share_says_where_the_share_came_from(tmp_path, monkeypatch):
    # LOCAL_WORLD_SIZE divides every tier's free space among the node's
    # processes (and two tiers on one file system split it too): before,
    # the error said only "the tiers hold 80.3 KiB", on a disk with 77 GB
    # free.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 ** 31 - 1))
    tiers = tier_dirs(tmp_path)
    with pytest.raises(errors.TierFullError) as err:
        wrap(make_model(), tiers).close()
    msg = str(err.value)
    for part in (f"tier 0 ({tiers[0]})", f"tier 1 ({tiers[1]})",
                 f"/ {2 ** 31 - 1} processes of the node (shared_by) / 2 tiers on that file "
                 f"system",
                 f"LOCAL_WORLD_SIZE {2 ** 31 - 1}"):
        assert part in msg, msg
    assert os.listdir(tiers[0]) == os.listdir(tiers[1]) == []


def test_a_tier_lock_directory_that_takes_no_files_is_named_with_its_source(tmp_path,
                                                                            monkeypatch):
    # /proc passes the directory checks, and the lock file's open failed
    # with "open /proc/mlp_offload_tier_lock...: No such file or directory"
    # alone. It now names the tier, the tier lock directory, and the
    # environment variable it came from; the run directories made go again.
    monkeypatch.setenv("MLP_OFFLOAD_TIER_LOCK_DIR", "/proc")
    tiers = tier_dirs(tmp_path)
    with pytest.raises(errors.TierError,
                       match=r"tier 0: tier lock: tier lock directory /proc: .*"
                             r"\$MLP_OFFLOAD_TIER_LOCK_DIR's: unset it, or give tier_lock_dir"):
        wrap(make_model(), tiers).close()
    assert os.listdir(tiers[0]) == os.listdir(tiers[1]) == []
    with pytest.raises(errors.TierError, match=r"tier 0: tier lock: tier lock directory /proc: ") \
            as err:
        wrap(make_model(), tiers, tier_lock_dir="/proc").close()
    assert "MLP_OFFLOAD_TIER_LOCK_DIR" not in str(err.value)


@pytest.mark.parametrize("names,match", [
    (("fast", "fast"), r"tiers 0 and 1 have the name 'fast': give each tier its own name"),
    (("", "slow"), r"tier 0: 'name' is empty \(leave it out for 'tier0'\)"),
    ((" ", "slow"), r"tier 0: 'name' is empty"),
])
def test_tier_names_that_label_nothing_are_refused(tmp_path, names, match):
    # As `mlp-offload plan --tier` refuses them: statistics and plans label
    # the tiers by name.
    tiers = [{"path": p, "name": n} for p, n in zip(tier_dirs(tmp_path), names)]
    refused(tiers, match)


def test_a_given_name_that_meets_a_default_one_still_works(tmp_path):
    # Only names given are checked: tier 1's default name is "tier1" (a
    # review: refusing this broke a config that worked).
    a, b = tier_dirs(tmp_path)
    wrap(make_model(), [{"path": a, "name": "tier1"}, b]).close()


def test_an_io_option_given_a_bool_for_a_number_is_refused(tmp_path):
    # pybind11 casts True to the int 1 (one I/O thread), silently.
    refused(tier_dirs(tmp_path), r"io: bad value for 'num_threads': True \(a bool, not a "
                                 r"number\)", io={"num_threads": True})
