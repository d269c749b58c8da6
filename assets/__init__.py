"""The five software-defined assets, one module per stage (thin wiring over updatelens)."""
