"""placeholder"""
NAME = "lookup"
TITLE = "lookup"


def run(settings):
    return []
