"""The base class of every error nasdiag raises on purpose.

A `NasdiagError` means the user asked for something that cannot be done; its message is one line that
says what was wrong and how to fix it, so that the CLI can print it as is and exit with code 2.
Subpackages derive their own errors from it (``RecordError``, ``DataError``, ``PlotError``,
``UnsupportedModuleError``, ``ConfigError``, ...).
"""


class NasdiagError(Exception):
    """A user-facing error with a one-line, actionable message."""


class ConfigError(NasdiagError, ValueError):
    """A search configuration or hyperparameter is invalid (unknown key, wrong type, out of range)."""


def _bytes_or_escape(exc):
    """The error handler of `paths_on_stdout`: a file name's surrogates back as its bytes (``surrogateescape``), any
    other character the encoding lacks as its escape (``\\u03b1``, as standard error writes it)."""
    import codecs

    if isinstance(exc, UnicodeEncodeError) and all(0xDC80 <= ord(c) <= 0xDCFF for c in exc.object[exc.start:exc.end]):
        return codecs.lookup_error("surrogateescape")(exc)
    return codecs.lookup_error("backslashreplace")(exc)


def paths_on_stdout():
    """Let standard output print any file name: one that is not UTF-8 (``$'\\xff.h5'``, from a Latin-1 system) reaches
    Python as surrogates, which a strict UTF-8 stdout (any locale but C, PYTHONIOENCODING=utf-8) refused with a
    UnicodeEncodeError traceback after the run was done ("record: ..."). Written back as its bytes, as ``ls`` does.
    And any text on a stdout whose encoding lacks its characters (a Latin-1 locale, PYTHONIOENCODING=ascii, the C locale
    without UTF-8 mode): ``nasdiag methods`` and ``nasdiag search --help`` (α, Θ, ξ) were a UnicodeEncodeError
    traceback; such a character is written as its escape. Returns the previous error handler to restore
    (``sys.stdout.reconfigure(errors=...)``), or None when nothing changed."""
    import sys

    return _bytes_on(sys.stdout, ("strict", "surrogateescape"))


def paths_on_stderr():
    """As `paths_on_stdout`, for the error lines on standard error, whose handler writes a file name's surrogates as
    escapes: ``$'\\xff.h5'`` was '\\udcff.h5', so the command printed after Ctrl-C to resume the run named another
    file. Returns the previous error handler to restore, or None."""
    import sys

    return _bytes_on(sys.stderr, ("strict", "surrogateescape", "backslashreplace"))


def _bytes_on(stream, handlers):
    """Give ``stream`` the handler `_bytes_or_escape` if its own is one of ``handlers``: the previous one, or None."""
    import codecs

    errors = getattr(stream, "errors", None)
    if errors not in handlers or not hasattr(stream, "reconfigure"):
        return None
    try:
        codecs.register_error("nasdiag.bytes_or_escape", _bytes_or_escape)
        stream.reconfigure(errors="nasdiag.bytes_or_escape")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - a stream that cannot change now
        return None
    return errors


def raised_warning(exc: Warning) -> str:
    """What to say of a warning raised as an error (``PYTHONWARNINGS=error``, ``python -W error``): the warning itself
    (not one of a cleanup it interrupted, such as the recorder's close) and how to let it be a warning; it was three
    chained tracebacks, exit code 1."""
    first = exc
    while isinstance(first.__context__, Warning):
        first = first.__context__
    return (f"{' '.join(str(first).split())} ({type(first).__name__}: a warning, raised as an error by PYTHONWARNINGS or "
            f"python -W); run with PYTHONWARNINGS unset, or 'default', to let nasdiag warn and go on")


def quiet_stdout() -> None:
    """After a closed pipe (``nasdiag methods | head -1``, ``script.py | head -1``) or a failed write of stdout: send
    what is left of stdout nowhere, so that Python's final flush does not complain about the pipe either."""
    import os
    import sys

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (captured in tests)
        pass


def run_script(prog: str, main, argv=None) -> int:
    """Run a batch script's ``main(argv)`` as the CLI runs a command: a `NasdiagError`, an `OSError` (an
    output folder that cannot be created, a full disk) or a warning raised as an error (`raised_warning`) is one line
    on stderr and exit code 2, Ctrl-C exits 130, and the reader of standard output gone (``script.py | head -1``)
    exits 141 without a word, as ``nasdiag`` does (it was "error: Broken pipe", exit code 2, or Python's "Exception
    ignored ... BrokenPipeError" from the final flush, exit code 120);
    anything else is a bug and keeps its traceback. ``main`` returns an exit code or None (0).

    Use it as ``sys.exit(run_script("name", main))`` under ``if __name__ == "__main__":``.
    """
    import sys

    previous_errors, previous_stderr = paths_on_stdout(), paths_on_stderr()  # a script prints the paths it wrote
    try:
        code = int(main(argv) or 0)
        if sys.stdout is not None:  # None: started with stdout closed (>&-)
            sys.stdout.flush()  # here, not at the interpreter's exit: a closed pipe (or a full disk) is this function's
        return code
    except BrokenPipeError:  # | head: the reader went away; not an error of the script (SIGPIPE's exit code)
        quiet_stdout()
        return 141
    except NasdiagError as err:
        print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
    except Warning as err:
        print(f"{prog}: error: {raised_warning(err)}", file=sys.stderr)
    except OSError as err:
        where = f": {err.filename}" if getattr(err, "filename", None) else ""
        print(f"{prog}: error: {err.strerror or err}{where}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous_errors is not None:
            sys.stdout.reconfigure(errors=previous_errors)
        if previous_stderr is not None:
            sys.stderr.reconfigure(errors=previous_stderr)
    return 2
