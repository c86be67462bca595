//! Redlock over several independent Redis masters (`redlock://h1:p1,h2:p2,…`).
