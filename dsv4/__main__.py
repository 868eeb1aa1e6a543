import sys

from .errors import exit_process, interrupted, watch_interrupts

watch_interrupts()
try:
    from .cli import main
except BaseException:  # Ctrl-C while the command line loads: one line, as in main()
    if not interrupted():
        raise
    print("interrupted", file=sys.stderr)
    exit_process(130)

exit_process(main())
