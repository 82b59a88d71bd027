def pytest_addoption(parser):
    parser.addoption("--wheel", default=None, help="path of the built wheel")
