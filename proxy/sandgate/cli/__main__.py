"""`python -m sandgate.cli`: how workers, tests and the benchmark start the command."""

import sys
from typing import NoReturn

from sandgate.cli import main


def exit_with(status: int) -> NoReturn:
    """Exit with the status the command returned.

    CPython (`run_eval_code_obj`) marks a KeyboardInterrupt that ended code run from a string
    (exec and eval, which dataclass and namedtuple creation use) as unhandled even when a caller
    caught it, and under `python -m` the interpreter then kills itself with SIGINT at exit
    instead of exiting with the status: `sandgate demo` interrupted at such a moment died by
    SIGINT after its cleanup instead of exiting 130. A string exec clears the mark. A
    KeyboardInterrupt no command caught never gets here, and still ends the process by SIGINT.
    """
    exec("None")  # noqa: S102 (a constant string: only its side effect on the mark matters)
    sys.exit(status)


if __name__ == "__main__":
    exit_with(main())
