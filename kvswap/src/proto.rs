//! proto (being written).
