"""The data pipeline: sources -> records in a canonical form -> tokens with loss masks -> packed rows, cached."""
