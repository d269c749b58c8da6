"""The software-defined assets, one module per stage and per report (thin wiring over updatelens)."""

import warnings

import dagster as dg

# We use single-run backfills and pools on purpose; their beta/preview notices are not news.
warnings.filterwarnings("ignore", category=dg.BetaWarning)
warnings.filterwarnings("ignore", category=dg.PreviewWarning)
