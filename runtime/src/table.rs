//! Plain-text tables for the CLI.
//!
//! ```text
//! format  bits  error
//! ------  ----  -----
//! fp16      16  0.000
//! ```
//!
//! Columns are separated by two spaces; the header is underlined with `-` as wide as each
//! column; lines carry no trailing spaces and the rendering ends without a final newline.
//! Widths count `char`s.

use std::fmt;

/// A table of string cells with a header row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
    right: Vec<bool>,
}

impl Table {
    /// An empty table with the given column headers (all columns left-aligned).
    pub fn new(headers: &[&str]) -> Table {
        Table {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
            right: vec![false; headers.len()],
        }
    }

    /// Appends a row.
    ///
    /// # Panics
    /// If `cells` does not have one cell per column.
    pub fn row(&mut self, cells: Vec<String>) {
        assert_eq!(
            cells.len(),
            self.headers.len(),
            "table row has {} cells for {} columns",
            cells.len(),
            self.headers.len()
        );
        self.rows.push(cells);
    }

    /// Right-aligns `column` (header included), e.g. for numbers.
    ///
    /// # Panics
    /// If `column` is out of range.
    pub fn right_align(&mut self, column: usize) {
        assert!(
            column < self.right.len(),
            "column {column} out of range for a table of {} columns",
            self.right.len()
        );
        self.right[column] = true;
    }

    fn widths(&self) -> Vec<usize> {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        widths
    }

    fn write_line(
        &self,
        f: &mut fmt::Formatter<'_>,
        cells: &[String],
        widths: &[usize],
    ) -> fmt::Result {
        let mut line = String::new();
        for (i, (cell, &w)) in cells.iter().zip(widths).enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            let pad = w - cell.chars().count();
            if self.right[i] {
                line.extend(std::iter::repeat_n(' ', pad));
                line.push_str(cell);
            } else {
                line.push_str(cell);
                line.extend(std::iter::repeat_n(' ', pad));
            }
        }
        f.write_str(line.trim_end())
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let widths = self.widths();
        self.write_line(f, &self.headers, &widths)?;
        let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
        f.write_str("\n")?;
        f.write_str(rule.join("  ").trim_end())?;
        for row in &self.rows {
            f.write_str("\n")?;
            self.write_line(f, row, &widths)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cells(xs: &[&str]) -> Vec<String> {
        xs.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn table_renders_three_by_three_exactly() {
        let mut t = Table::new(&["format", "bits", "rel err"]);
        t.right_align(1);
        t.right_align(2);
        t.row(cells(&["fp16", "16", "0.0001"]));
        t.row(cells(&["int4-per-channel", "4.25", "0.031"]));
        t.row(cells(&["pq", "2", "0.12"]));
        let expect = "\
format            bits  rel err
----------------  ----  -------
fp16                16   0.0001
int4-per-channel  4.25    0.031
pq                   2     0.12";
        assert_eq!(t.to_string(), expect);
    }

    #[test]
    fn table_has_no_trailing_spaces_with_left_aligned_last_column() {
        let mut t = Table::new(&["a", "name"]);
        t.right_align(0);
        t.row(cells(&["1", "x"]));
        t.row(cells(&["100", "longer"]));
        let s = t.to_string();
        assert_eq!(s, "  a  name\n---  ------\n  1  x\n100  longer");
        assert!(s.lines().all(|l| !l.ends_with(' ')));
    }

    #[test]
    fn table_counts_chars_not_bytes() {
        let mut t = Table::new(&["µ", "b"]);
        t.row(cells(&["ααα", "1"]));
        assert_eq!(t.to_string(), "µ    b\n---  -\nααα  1");
    }

    #[test]
    #[should_panic(expected = "cells")]
    fn table_rejects_wrong_row_width() {
        let mut t = Table::new(&["a", "b"]);
        t.row(cells(&["only one"]));
    }
}
