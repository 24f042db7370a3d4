//! Parameter groups: the options a user changes while training (learning rate, weight decay,
//! momentum), per group, held once for the whole model.
//!
//! A model's trainable variables are split over several libtorch optimizers (one per streamed
//! block on the host, one on the device), but tch users address one optimizer with one set of
//! groups (`Path::set_group`, `set_weight_decay_group`, `set_lr`). This table is that one set;
//! every libtorch optimizer copies the options of the groups it holds from it before a step,
//! whenever it changed. Semantics follow libtorch's as tch drives it: the groups that exist when
//! the optimizer is made start from the defaults; `set_*` changes the defaults and every group;
//! `set_*_group` changes one group; a group made later starts from the defaults of that time.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// The options of one parameter group that tch lets a user change.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GroupOptions {
    pub lr: f64,
    pub weight_decay: f64,
    /// SGD's and RMSprop's momentum, Adam's and AdamW's `beta1` (as tch's `set_momentum`).
    pub momentum: f64,
}

/// The groups and their options, with a version that changes whenever an option does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Groups {
    defaults: GroupOptions,
    groups: Vec<GroupOptions>,
    #[serde(skip)]
    version: u64,
}

impl Groups {
    /// `count` groups (at least one, as libtorch always has group 0) starting from `defaults`.
    pub(crate) fn new(defaults: GroupOptions, count: usize) -> Groups {
        Groups {
            defaults,
            groups: vec![defaults; count.max(1)],
            version: 1,
        }
    }

    /// Makes groups up to `group` (from the defaults of now).
    pub(crate) fn ensure(&mut self, group: usize) {
        if group >= self.groups.len() {
            self.groups.resize(group + 1, self.defaults);
            self.version += 1;
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.groups.len()
    }

    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    /// The options of `group` (the defaults for a group not made yet).
    pub(crate) fn get(&self, group: usize) -> GroupOptions {
        self.groups.get(group).copied().unwrap_or(self.defaults)
    }

    /// Changes the defaults and every group.
    pub(crate) fn set_all(&mut self, f: impl Fn(&mut GroupOptions)) {
        f(&mut self.defaults);
        self.groups.iter_mut().for_each(&f);
        self.version += 1;
    }

    /// Changes one group; an error names the groups there are.
    pub(crate) fn set(&mut self, group: usize, what: &str, f: impl FnOnce(&mut GroupOptions)) -> Result<()> {
        let n = self.len();
        let g = self.groups.get_mut(group).ok_or_else(|| {
            Error::misuse(
                format!("{what}: group {group}"),
                format!(
                    "one of the model's parameter groups, 0..{n} (a variable joins group g when it is made on `path.set_group(g)`)"
                ),
            )
        })?;
        f(g);
        self.version += 1;
        Ok(())
    }

    /// Checks options read from a file: as many groups as `expected`, every value finite, rates
    /// and decays not negative.
    pub(crate) fn check_loaded(&self, expected: usize) -> std::result::Result<(), String> {
        if self.groups.len() != expected {
            return Err(format!("{} parameter groups, but this optimizer has {expected}", self.groups.len()));
        }
        for (i, o) in std::iter::once(&self.defaults).chain(&self.groups).enumerate() {
            let ok = [o.lr, o.weight_decay, o.momentum].iter().all(|v| v.is_finite()) && o.lr >= 0.0 && o.weight_decay >= 0.0;
            if !ok {
                let which = if i == 0 { "the defaults".to_string() } else { format!("group {}", i - 1) };
                return Err(format!("{which} has options {o:?}; expected finite values, lr and weight_decay at or above 0"));
            }
        }
        Ok(())
    }

    /// Replaces every option (a loaded optimizer state), keeping the version moving.
    pub(crate) fn replace(&mut self, other: &Groups) {
        self.defaults = other.defaults;
        self.groups = other.groups.clone();
        self.version += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: GroupOptions = GroupOptions { lr: 0.1, weight_decay: 0.01, momentum: 0.9 };

    #[test]
    fn later_groups_start_from_the_defaults_of_their_time() {
        let mut g = Groups::new(D, 2);
        let v = g.version();
        g.set(1, "set_weight_decay_group", |o| o.weight_decay = 0.0).expect("group 1");
        g.set_all(|o| o.lr = 0.5);
        assert!(g.version() > v);
        assert_eq!(g.get(0), GroupOptions { lr: 0.5, ..D });
        assert_eq!(g.get(1), GroupOptions { lr: 0.5, weight_decay: 0.0, ..D });
        g.ensure(3);
        assert_eq!(g.len(), 4);
        assert_eq!(g.get(3), GroupOptions { lr: 0.5, ..D }, "a new group takes the defaults, not group 1's decay");
        let e = g.set(7, "set_lr_group", |o| o.lr = 1.0).expect_err("no group 7");
        assert!(e.to_string().contains("set_lr_group: group 7") && e.to_string().contains("0..4"), "{e}");
    }

    #[test]
    fn options_read_from_a_file_are_checked() {
        let mut g = Groups::new(D, 2);
        assert!(g.check_loaded(2).is_ok());
        assert!(g.check_loaded(3).expect_err("count").contains("2 parameter groups"));
        g.set(1, "set_lr_group", |o| o.lr = f64::NAN).expect("group 1");
        assert!(g.check_loaded(2).expect_err("nan").contains("group 1"));
        let mut g = Groups::new(D, 1);
        g.set_all(|o| o.weight_decay = -1.0);
        assert!(g.check_loaded(1).expect_err("negative").contains("the defaults"));
    }
}
