"""Dagster wiring: partitions, resources, jobs, sensors and the Definitions object, and the command
line (cli.py). Importing the package imports no Dagster: `updatelens sql` and `verify` need none."""
