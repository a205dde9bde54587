"""Scripts that measure and report, never asserted by tests; run each as a module from the project root
(`python -m benchmarks.strategy_report`)."""
