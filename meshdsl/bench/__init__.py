"""``meshdsl bench``: compile each model x layout, time them side by side, and report throughput,
memory and communication (measured from the compiled HLO beside ``md.explain``'s prediction)."""
