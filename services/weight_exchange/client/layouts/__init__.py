"""Layout providers: which canonical regions a rank of a given framework and parallelism holds."""
