"""PNG plots of the benchmark and of a training run (matplotlib, Agg)."""

import io
import os
import stat
import uuid

_COLORS = {
    "read_wait": "#d62728",
    "compute": "#2ca02c",
    "write_wait": "#ff7f0e",
    "grad_offload": "#9467bd",
    "other": "#c7c7c7",
    "forward_backward": "#1f77b4",
}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _prepare(path):
    """`path` as a str; its directory must exist (none is made)."""
    return os.fspath(path)


def _format_of(path):
    return os.path.splitext(path)[1][1:].lower() or "png"


def check_format(path):
    """Renders a small figure with some text in `path`'s format, in
    memory: a format matplotlib lists but cannot write here (pgf without
    LaTeX, which only text needs) fails now, not after a run. Raises what
    matplotlib raises."""
    plt = _pyplot()
    fig = plt.figure(figsize=(1, 1))
    fig.text(0.5, 0.5, "1 s")
    try:
        fig.savefig(io.BytesIO(), format=_format_of(path))
    finally:
        plt.close(fig)


def _save(fig, path, dpi):
    """Writes the figure to a new file beside `path`, then renames it over
    `path`: a full disk or a failed render leaves what was there (and no
    partial file). A symlink's target is what is replaced, and a file
    replaced keeps its permissions. An OSError names `path`."""
    target = os.path.realpath(path) if os.path.islink(path) else path
    tmp = os.path.join(os.path.dirname(os.path.abspath(target)),
                       f".{os.path.basename(target)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        with os.fdopen(fd, "wb") as f:
            try:
                os.fchmod(f.fileno(), stat.S_IMODE(os.stat(target).st_mode))
            except FileNotFoundError:
                pass  # a new file: the umask's mode
            fig.savefig(f, dpi=dpi, format=_format_of(path))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        _unlink_quietly(tmp)
        raise OSError(e.errno, f"writing the plot: {e.strerror or e}", path) from e
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _unlink_quietly(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def plot_bench(results, path, title=None):
    """Stacked bars of each configuration's median step: read wait, compute,
    write wait, gradient offload, the rest; markers for the I/O lower bound
    and the planner's prediction. Returns the path."""
    path = _prepare(path)
    plt = _pyplot()
    names = [r["config"] for r in results]
    parts = ("read_wait", "compute", "write_wait", "grad_offload")
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(results) + 2.2))
    left = [0.0] * len(results)
    y = list(range(len(results)))
    for part in parts:
        vals = [r[f"{part}_seconds"] for r in results]
        ax.barh(y, vals, left=left, color=_COLORS[part], label=part.replace("_", " "))
        left = [a + b for a, b in zip(left, vals)]
    other = [max(0.0, r["step_seconds_median"] - l) for r, l in zip(results, left)]
    ax.barh(y, other, left=left, color=_COLORS["other"], label="other")
    ax.scatter([r["io_lower_bound_seconds"] for r in results], y, marker="|", s=300,
               color="black", label="I/O lower bound", zorder=3)
    ax.scatter([r["predicted_seconds"] for r in results], y, marker="x", color="black",
               label="planner prediction", zorder=3)
    for yi, r in zip(y, results):
        ax.text(r["step_seconds_median"], yi, f" {r['step_seconds_median']:.2f} s",
                va="center", fontsize=8)
    ax.set_yticks(y)
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xlabel("update phase, median step (s)")
    ax.set_title(title or "MLP-Offload update phase: where the time goes")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    _save(fig, path, dpi=110)
    plt.close(fig)
    return path


def plot_train(runs, path, title=None):
    """Loss per step of each run (left), step time per step (middle), and
    the mean step split into forward+backward and the update phase's parts
    (right). `runs` maps a
    mode name to the dict train.train_run returns. Returns the path."""
    path = _prepare(path)
    plt = _pyplot()
    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(16, 4.5))
    styles = {"mlp": "-", "baseline": "--", "torch": ":"}
    for mode, run in runs.items():
        ax1.plot(range(1, len(run["loss"]) + 1), run["loss"], styles.get(mode, "-"),
                 label=mode)
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax1.set_title("loss")
    ax1.legend()
    for mode, run in runs.items():
        ax3.plot(range(1, len(run["step_seconds"]) + 1), run["step_seconds"],
                 styles.get(mode, "-"), label=mode)
    ax3.set_xlabel("step")
    ax3.set_ylabel("step time (s)")
    ax3.set_title("step time")
    ax3.legend()
    modes = list(runs)
    parts = ("forward_backward", "read_wait", "compute", "write_wait", "grad_offload",
             "other")
    bottom = [0.0] * len(modes)
    for part in parts:
        vals = [runs[m]["mean_seconds"].get(part, 0.0) for m in modes]
        ax2.bar(modes, vals, bottom=bottom, color=_COLORS[part],
                label=part.replace("_", " "))
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax2.set_ylabel("mean step time (s)")
    ax2.set_title("where a step's time goes")
    ax2.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    _save(fig, path, dpi=110)
    plt.close(fig)
    return path
