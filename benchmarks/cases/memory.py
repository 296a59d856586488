"""placeholder"""
NAME = "memory"
TITLE = "memory"


def run(settings):
    return []
