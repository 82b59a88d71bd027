"""py_wheel_zip: minimal offline replacement for rules_python's py_wheel.

Neither rules_python nor any wheel rule is packaged by Debian, and Bazel 4.2.3
does not bundle one, so this rule runs //tools/wheel:build_wheel.
"""

def _py_wheel_zip_impl(ctx):
    tag = "%s-%s-%s" % (ctx.attr.python_tag, ctx.attr.abi_tag, ctx.attr.platform_tag)
    out = ctx.actions.declare_file("%s-%s-%s.whl" % (
        ctx.attr.distribution.replace("-", "_"),
        ctx.attr.version,
        tag,
    ))
    args = ctx.actions.args()
    args.add("--out", out)
    args.add("--name", ctx.attr.distribution)
    args.add("--version", ctx.attr.version)
    args.add("--tag", tag)
    for r in ctx.attr.requires:
        args.add("--requires", r)
    for group, specs in ctx.attr.entry_points.items():
        for spec in specs:
            args.add("--entry_point", "%s:%s" % (group, spec))
    if ctx.attr.bundle_libs:
        args.add("--bundle_libs", ctx.attr.bundle_libs)
        args.add("--libs_dir", ctx.attr.package_dir + ".libs")
    inputs = []
    for src in ctx.files.srcs:
        inputs.append(src)
        args.add("--file", "%s/%s=%s" % (ctx.attr.package_dir, src.basename, src.path))
    ctx.actions.run(
        outputs = [out],
        inputs = inputs,
        executable = ctx.executable._builder,
        arguments = [args],
        mnemonic = "PyWheel",
        progress_message = "Building wheel %s" % out.short_path,
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

py_wheel_zip = rule(
    implementation = _py_wheel_zip_impl,
    attrs = {
        "distribution": attr.string(mandatory = True),
        "version": attr.string(mandatory = True),
        "python_tag": attr.string(default = "py3"),
        "abi_tag": attr.string(default = "none"),
        "platform_tag": attr.string(default = "any"),
        "package_dir": attr.string(mandatory = True),
        "srcs": attr.label_list(allow_files = True),
        "requires": attr.string_list(),
        # {"console_scripts": ["name = module:function", ...]}
        "entry_points": attr.string_list_dict(),
        # Regex of sonames copied into <package_dir>.libs/ (see build_wheel.py);
        # the extension must be linked with an RPATH to that directory.
        "bundle_libs": attr.string(),
        "_builder": attr.label(
            default = "//tools/wheel:build_wheel",
            executable = True,
            cfg = "exec",
        ),
    },
)
