"""A process that has imported torch once and forks training processes.

Importing torch takes seconds here; kill tests start dozens of training
processes, so they are forked from this server instead. The server reads
one JSON command per line on stdin: {"wait": pid} answers the wait status of
a child; anything else forks a child that runs `<module>.train(cmd)` and
answers its pid. A child that raises appends "error <traceback as JSON>" to
cmd["progress"] and exits 1.
"""

import json
import subprocess
import sys

_SERVER = r'''
import json, os, sys, traceback
sys.path[:0] = json.loads(sys.argv[1])
import torch, mlp_offload
import torch.distributed
import torch._dynamo  # torch.optim imports it on first use: seconds, so here
child = __import__(sys.argv[2])
for line in sys.stdin:
    cmd = json.loads(line)
    if "wait" in cmd:
        _, status = os.waitpid(cmd["wait"], 0)
        print(status, flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            child.train(cmd)
        except BaseException:
            with open(cmd["progress"], "a") as f:
                f.write("error " + json.dumps(traceback.format_exc()) + "\n")
            code = 1
        os._exit(code)
    print(pid, flush=True)
'''


class Server:
    """Forks children running `train(cmd)` of the module `source` defines."""

    def __init__(self, tmp_path, module, source):
        (tmp_path / f"{module}.py").write_text(source)
        paths = [str(tmp_path)] + [p for p in sys.path if p]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, json.dumps(paths), module],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _ask(self, cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the fork server died"
        return int(line)

    def start(self, **cmd):
        return self._ask(cmd)

    def wait(self, pid):
        return self._ask({"wait": pid})

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def read_events(path, on_error=None):
    """The child's progress lines, split in words. A reported error fails the
    test, unless `on_error(traceback)` (which may assert) gives the event to
    record in its place."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        if line.startswith("error "):
            trace = json.loads(line[len("error "):])
            assert on_error is not None, trace
            events.append(on_error(trace))
        elif line:
            events.append(line.split(" "))
    return events


def assert_same_run(got_path, want_path):
    """The {"params", "state_dict"} saved by two runs are bit for bit equal."""
    import torch
    want = torch.load(want_path, weights_only=True)
    got = torch.load(got_path, weights_only=True)
    for i, (a, b) in enumerate(zip(got["params"], want["params"])):
        assert torch.equal(a, b), f"parameter {i} differs from the uninterrupted run"
    assert got["state_dict"]["param_groups"] == want["state_dict"]["param_groups"]
    assert got["state_dict"]["state"].keys() == want["state_dict"]["state"].keys()
    for pid, st in want["state_dict"]["state"].items():
        for key, value in st.items():
            assert torch.equal(got["state_dict"]["state"][pid][key], value), (pid, key)
