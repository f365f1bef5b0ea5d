"""Plain-array algorithms, apart from the IR, each testable against brute force or networkx."""
