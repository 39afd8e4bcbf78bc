"""Executors run the workers: in process (uni) now; multiprocess and Ray arrive with issue #11."""
