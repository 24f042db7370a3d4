//! Atomic file replacement: a checkpoint is written to a temporary file beside its destination,
//! flushed to disk, and renamed over the destination, so a crash or a full disk mid-write leaves
//! the previous checkpoint whole (never a truncated file under the real name).

use crate::error::{Error, Result};
use std::path::Path;

/// Writes `path` atomically: `write` fills a temporary file (given its path) in the same folder,
/// which then replaces `path`. On any error the destination is untouched and the temporary file
/// is removed.
pub(crate) fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = path.file_name().ok_or_else(|| Error::Config {
        field: "path",
        value: format!("'{}'", path.display()),
        expected: "a file path (with a file name)".into(),
    })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let prefix = format!(".{}.", name.to_string_lossy());
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".partial");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // What a plain File::create gives under the usual umask (tempfile's default is 0600).
        builder.permissions(std::fs::Permissions::from_mode(0o644));
    }
    let tmp = builder.tempfile_in(dir).map_err(|e| Error::io(dir, e))?;
    write(tmp.path())?;
    // The writer may have used its own handle: flushing ours flushes the same file.
    std::fs::File::open(tmp.path())
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io(tmp.path(), e))?;
    tmp.persist(path).map_err(|e| Error::io(path, e.error))?;
    // The rename itself is durable once the folder is flushed (best effort: not every
    // filesystem lets a folder be opened).
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_keeps_the_old_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("model.ot");
        std::fs::write(&path, b"old").expect("old");
        let e = write_atomic(&path, |tmp| {
            std::fs::write(tmp, b"half").map_err(|e| Error::io(tmp, e))?;
            Err(Error::internal("disk full"))
        })
        .expect_err("fails");
        assert!(e.to_string().contains("disk full"));
        assert_eq!(std::fs::read(&path).expect("read"), b"old");
        assert_eq!(std::fs::read_dir(dir.path()).expect("ls").count(), 1, "no temporary left");
        write_atomic(&path, |tmp| std::fs::write(tmp, b"new").map_err(|e| Error::io(tmp, e))).expect("writes");
        assert_eq!(std::fs::read(&path).expect("read"), b"new");
        assert_eq!(std::fs::read_dir(dir.path()).expect("ls").count(), 1);
        let e = write_atomic(Path::new("/"), |_| Ok(())).expect_err("no file name");
        assert!(e.to_string().contains("a file path"), "{e}");
    }
}
