"""A preloaded interpreter for the command tests (tests/cli_helpers.py starts it once).

It imports torch and every ``hpf`` command once, then forks one child per command. The child
runs it as ``python -m hpf`` (or ``python -c CODE``) would: its own argv, environment, working
folder, stdin from /dev/null, stdout and stderr into files, and its exit code. hpf reads its
environment when called, never at import, so a command sees the environment it was given. What
it saves is the start-up import, about 2-4 s a command on this 2-core machine.

Protocol: a JSON request per line on stdin; the reply is a line {"pid": P}, then {"code": C}.
"""
import atexit
import json
import os
import runpy
import sys
import traceback


def main() -> None:
    import importlib

    from hpf.cli.command import COMMANDS, SHARED_MODULES

    for name in COMMANDS:  # every command's module, and through them torch, hpf and DCP
        importlib.import_module(f"hpf.cli.{SHARED_MODULES.get(name, name)}")
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run(request)  # (never returns)
        _reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _reply({"code": os.waitstatus_to_exitcode(status)})


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _run(request: dict) -> None:
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group: a timeout ends the command and the ranks it forked
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                                (2, request["stderr"], os.O_WRONLY)):
            os.dup2(os.open(path, flags), fd)
        sys.argv = request["argv"]
        if request["code"] is not None:
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
        else:
            runpy.run_module("hpf", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback, exit 1
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # (as the interpreter's exit does: hpf's report of lost async saves)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


if __name__ == "__main__":
    main()
