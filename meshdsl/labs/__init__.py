"""Labs: small end-to-end experiments run from the command line (``meshdsl lab-digits``)."""
