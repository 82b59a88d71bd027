"""Assemble a PEP 427 wheel (a zip) from files produced by Bazel.

Usage: build_wheel.py [--entry_point GROUP:SPEC]...
       --out X.whl --name N --version V --tag cp311-cp311-linux_x86_64
                      [--requires R]... --file DEST=SRC [--file DEST=SRC]...
                      [--bundle_libs REGEX --libs_dir DIR]
Deterministic: sorted entries, fixed timestamps.

--bundle_libs makes the wheel self-contained the way auditwheel does: every
shared library that an extension module (a --file ending in .so) loads,
directly or through another library, and whose soname matches REGEX, is
copied into DIR/ of the wheel under its soname. The extension must be linked
with DT_RPATH (not RUNPATH) $ORIGIN/../DIR: the loader then finds the copies
for the extension and for their own dependencies, before any system copy.
"""
import argparse
import base64
import hashlib
import os
import re
import stat
import subprocess
import sys
import zipfile

EPOCH = (1980, 1, 1, 0, 0, 0)


def _record_hash(data):
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _loaded_libraries(path):
    """{soname: resolved path} of every library `path` loads (ldd's closure)."""
    out = subprocess.run(["ldd", path], check=True, capture_output=True, text=True).stdout
    libs = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) => (\S+) \(0x", line)
        if m:
            libs[m.group(1)] = m.group(2)
        elif "=> not found" in line:
            sys.exit("build_wheel: %s needs %s, which is not found" % (path, line.split()[0]))
    return libs


def _bundle(entries, files, pattern, libs_dir):
    bundled = {}
    for src in files:
        if not src.endswith(".so"):
            continue
        for soname, lib in _loaded_libraries(src).items():
            if re.match(pattern, soname):
                bundled[soname] = os.path.realpath(lib)
    if not bundled:
        sys.exit("build_wheel: no library matching %r to bundle" % pattern)
    for soname, lib in bundled.items():
        with open(lib, "rb") as f:
            entries["%s/%s" % (libs_dir, soname)] = (f.read(), False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--summary", default="")
    p.add_argument("--requires", action="append", default=[])
    p.add_argument("--file", action="append", default=[])
    p.add_argument("--entry_point", action="append", default=[],
                   help="GROUP:NAME = MODULE:FUNC")
    p.add_argument("--bundle_libs", default="",
                   help="regex of sonames to copy into --libs_dir")
    p.add_argument("--libs_dir", default="")
    a = p.parse_args()
    if bool(a.bundle_libs) != bool(a.libs_dir):
        p.error("--bundle_libs and --libs_dir go together")

    dist_info = "%s-%s.dist-info" % (a.name, a.version)
    entries = {}  # dest -> (bytes, executable)
    for spec in a.file:
        dest, src = spec.split("=", 1)
        with open(src, "rb") as f:
            data = f.read()
        is_exec = bool(os.stat(src).st_mode & stat.S_IXUSR)
        entries[dest] = (data, is_exec)
    if a.bundle_libs:
        _bundle(entries, [spec.split("=", 1)[1] for spec in a.file], a.bundle_libs,
                a.libs_dir)

    metadata = ["Metadata-Version: 2.1", "Name: " + a.name, "Version: " + a.version]
    if a.summary:
        metadata.append("Summary: " + a.summary)
    metadata += ["Requires-Dist: " + r for r in a.requires]
    entries[dist_info + "/METADATA"] = (("\n".join(metadata) + "\n").encode(), False)
    wheel = [
        "Wheel-Version: 1.0",
        "Generator: mlp_offload-build_wheel",
        "Root-Is-Purelib: false",
        "Tag: " + a.tag,
    ]
    entries[dist_info + "/WHEEL"] = (("\n".join(wheel) + "\n").encode(), False)
    if a.entry_point:
        groups = {}
        for spec in a.entry_point:
            group, rest = spec.split(":", 1)
            groups.setdefault(group, []).append(rest)
        text = "".join("[%s]\n%s\n\n" % (g, "\n".join(v)) for g, v in sorted(groups.items()))
        entries[dist_info + "/entry_points.txt"] = (text.encode(), False)
    top = sorted({d.split("/", 1)[0] for d in entries if not d.startswith(dist_info)})
    entries[dist_info + "/top_level.txt"] = (("\n".join(top) + "\n").encode(), False)

    record_name = dist_info + "/RECORD"
    record_lines = []
    for dest in sorted(entries):
        data, _ = entries[dest]
        record_lines.append("%s,%s,%d" % (dest, _record_hash(data), len(data)))
    record_lines.append(record_name + ",,")
    entries[record_name] = (("\n".join(record_lines) + "\n").encode(), False)

    # dist-info last, as recommended by PEP 427
    order = sorted(d for d in entries if not d.startswith(dist_info))
    order += sorted(d for d in entries if d.startswith(dist_info) and d != record_name)
    order.append(record_name)
    with zipfile.ZipFile(a.out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for dest in order:
            data, is_exec = entries[dest]
            info = zipfile.ZipInfo(dest, date_time=EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = ((0o755 if is_exec else 0o644) | stat.S_IFREG) << 16
            z.writestr(info, data)


if __name__ == "__main__":
    main()
