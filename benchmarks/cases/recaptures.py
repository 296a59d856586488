"""placeholder"""
NAME = "recaptures"
TITLE = "recaptures"


def run(settings):
    return []
