import sys

try:
    from .cli import main
except KeyboardInterrupt:                   # Ctrl-C while the command line loads: one line, as in main()
    print("interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
